"""The budget-transfer figure of a search: each checked point's score at the trial budget against its
score at ``factor`` x the budget, per schedule, with Spearman's rank correlation (best.yaml's
``transfer_check``, written by a search with ``search.transfer_check``).

    python bench/transfer_figure.py runs/transfer/best.yaml --out docs/transfer-check.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("best", help="best.yaml of a search run with search.transfer_check")
    ap.add_argument("--out", default="transfer-check.png")
    args = ap.parse_args()
    best = yaml.safe_load(Path(args.best).read_text())
    t = best.get("transfer_check")
    if not t:
        raise SystemExit(f"{args.best}: no transfer_check (search with search.transfer_check: {{top: 5}})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short_budget = float(best["budget"]["seconds"])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for s, color, marker in (("paci", "tab:blue", "o"), ("1f1b", "tab:orange", "s")):
        pts, rho = t[s]["points"], t[s]["spearman"]
        label = f"{'PACI' if s == 'paci' else 'flush'}: Spearman {'-' if rho is None else f'{rho:.2f}'} (n={t[s]['n']})"
        ax.scatter([p["short"] for p in pts], [p["long"] for p in pts], color=color, marker=marker, label=label)
        for p in pts:
            ax.annotate(
                p["point"].split(" ", 1)[1],
                (p["short"], p["long"]),
                fontsize=7,
                xytext=(4, 2),
                textcoords="offset points",
            )
    ax.axvline(short_budget, color="grey", lw=0.7, ls=":")
    ax.axhline(t["seconds"], color="grey", lw=0.7, ls=":")
    ax.set_xlabel(f"score at the trial budget, {short_budget:g} s (beyond the line: missed, penalty)")
    ax.set_ylabel(f"score at {t['factor']:g}x the budget, {t['seconds']:g} s")
    pooled = t["pooled"]["spearman"]
    ax.set_title(
        f"Budget transfer: pooled Spearman {'-' if pooled is None else f'{pooled:.2f}'} (n={t['pooled']['n']})",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Weight versions of one stage: which backward sees which weights, at one copy per version still needed.

A stage's weights change at each optimizer step; version ``v`` is the weights after ``v`` updates.
Under PACI a micro-batch's backward can run after steps its forward did not see. Two semantics:

- ``current``: the backward reads the weights as they are now (the paper's text, "no weight
  stashing"); nothing is copied (:mod:`.optim` steps through aliases so autograd allows it).
- ``forward``: every backward uses the values its forward used -- what the reference code did in
  practice, since its forwards ran under ``torch.autocast(bfloat16)``, whose per-forward weight casts
  autograd keeps for the backward. Each matmul's gradient is then consistent, only late.

``forward`` is implemented **copy on step**, not copy on forward. While a stage forward runs
(:meth:`WeightVersions.recording`), a saved-tensors pack hook replaces every tensor autograd saves
that lives in a parameter's storage (the weight itself, ``weight.t()``, any view) by a reference:
(storage, version, size, stride, offset). Nothing is copied at forward time. When an optimizer step
is about to overwrite version ``v`` (:meth:`WeightVersions.preserve`) and some micro-batch in flight
still references ``v``, the stage's parameter storages are cloned once, in the compute dtype (bf16
weights in bf16; the fp32 masters are never copied). The unpack hook then hands a backward either
the live storage (its version is still current) or that copy, viewed with the saved geometry. The
copy is freed when the last holder of ``v`` is done. So a stage holds at most one copy per version
an in-flight micro-batch still needs, shared by all of them: at most ``ceil((k-1)/a)`` copies with
``k`` micro-batches in flight (1 when ``a >= P-1``, 0 at the last stage and under every flush
schedule, which never steps with a micro-batch in flight) -- :func:`paci_tune.schedule.copies_bound`. The reference
keeps ``P - s`` casts; PipeDream-2BW keeps two versions for the same reason.

Evaluation without a drain uses the same store: a pending evaluation holds its version
(:meth:`hold`) and scores :meth:`weights` of it, the live parameters or the copy a later step made.
Under weight prediction (:mod:`.optim`) the parameters hold the extrapolated weights the forwards
run on, and the weights the optimizer trains are the fp32 masters (``truth``): an evaluation scores
those -- the masters themselves, or their copy a later step made when an evaluation still held the
version -- so a validation loss is the trained model's, never its extrapolation. May import: torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def _clone(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A copy of ``storage``, made by a tensor operator (a byte view's ``clone``) rather than the storage's
    own ``clone``, so allocation meters that watch operators (:mod:`.meter`) see the copy as memory."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).clone().untyped_storage()


@dataclass(frozen=True)
class _Ref:
    """What a backward will read in place of a saved tensor that lived in a parameter's storage."""

    key: int  # the live storage's data_ptr
    version: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Layout:
    """Where a named parameter lives in its storage (to rebuild it from a copy of that storage)."""

    key: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class WeightVersions:
    """The versions of one stage's weights still referenced, and the hooks that reference them."""

    def __init__(
        self, named_params: Sequence[tuple[str, torch.Tensor]], truth: Sequence[torch.Tensor] | None = None
    ) -> None:
        """``truth``: per parameter, in order, the weights evaluations score instead (module docstring)."""
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._layouts: dict[str, _Layout] = {}
        for name, p in named_params:
            storage = p.untyped_storage()
            key = storage.data_ptr()
            self._storages.setdefault(key, storage)
            self._layouts[name] = _Layout(key, p.dtype, p.size(), p.stride(), p.storage_offset())
        self.current = 0  # the version the parameters hold now (= the stage's updates)
        self._truth = dict(zip([n for n, _ in named_params], truth, strict=True)) if truth is not None else None
        self._dtypes = {n: p.dtype for n, p in named_params}
        self._truth_copies: dict[int, dict[str, torch.Tensor]] = {}
        self._evaluations: dict[int, int] = {}  # version -> pending evaluations holding it
        self._holders: dict[int, int] = {}
        self._copies: dict[int, dict[int, torch.UntypedStorage]] = {}
        self.copies_made = 0
        self.peak_copies = 0

    # ------------------------------------------------------------------------------- holders
    def hold(self, version: int, evaluation: bool = False) -> None:
        """Something (a micro-batch in flight, a pending ``evaluation``) will read ``version`` later."""
        self._holders[version] = self._holders.get(version, 0) + 1
        if evaluation:
            self._evaluations[version] = self._evaluations.get(version, 0) + 1

    def release(self, version: int, evaluation: bool = False) -> None:
        """One holder of ``version`` is done; its copy is freed with the last one."""
        if evaluation:
            left = self._evaluations[version] - 1
            if left:
                self._evaluations[version] = left
            else:
                del self._evaluations[version]
                self._truth_copies.pop(version, None)
        left = self._holders[version] - 1
        if left:
            self._holders[version] = left
        else:
            del self._holders[version]
            self._copies.pop(version, None)

    def release_all(self) -> None:
        self._holders.clear()
        self._copies.clear()
        self._evaluations.clear()
        self._truth_copies.clear()

    # ---------------------------------------------------------------------------------- steps
    @torch.no_grad()
    def preserve(self) -> None:
        """Before a step overwrites the current version: copy it if anything still holds it."""
        if self._holders.get(self.current) and self.current not in self._copies:
            self._copies[self.current] = {k: _clone(s) for k, s in self._storages.items()}
            self.copies_made += 1
            self.peak_copies = max(self.peak_copies, len(self._copies))
        if self._truth is not None and self._evaluations.get(self.current) and self.current not in self._truth_copies:
            self._truth_copies[self.current] = {n: t.detach().clone() for n, t in self._truth.items()}

    @property
    def copies(self) -> int:
        """Weight copies held now."""
        return len(self._copies)

    @property
    def weight_bytes(self) -> int:
        """Bytes of one copy: the stage's parameter storages."""
        return sum(s.nbytes() for s in self._storages.values())

    def _storage(self, key: int, version: int) -> torch.UntypedStorage:
        if version == self.current:
            return self._storages[key]
        try:
            return self._copies[version][key]
        except KeyError:
            raise RuntimeError(f"weights of version {version} were not kept (now at {self.current})") from None

    @staticmethod
    def _view(storage: torch.UntypedStorage, dtype: torch.dtype, size, stride, offset: int) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)

    # --------------------------------------------------------------------------- the backward
    def _pack(self, t: torch.Tensor) -> object:
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage (sparse, nested)
            return t
        if key not in self._storages:
            return t
        return _Ref(key, self.current, t.dtype, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _Ref):
            assert isinstance(packed, torch.Tensor)
            return packed
        storage = self._storage(packed.key, packed.version)
        return self._view(storage, packed.dtype, packed.size, packed.stride, packed.offset)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Around a forward: what autograd saves from the weights is read back at this version."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    # ---------------------------------------------------------------------------- evaluation
    def weights(self, version: int) -> dict[str, torch.Tensor] | None:
        """The parameters at ``version`` by name; ``None`` while they are the live ones. Under weight
        prediction, the trained weights at ``version`` (module docstring), in the parameters' dtypes."""
        if self._truth is not None:
            held = self._truth if version == self.current else self._truth_copies.get(version)
            if held is None:
                raise RuntimeError(f"trained weights of version {version} were not kept (now at {self.current})")
            return {n: t.detach().to(self._dtypes[n]) for n, t in held.items()}
        if version == self.current:
            return None
        return {
            name: self._view(self._storage(lay.key, version), lay.dtype, lay.size, lay.stride, lay.offset)
            for name, lay in self._layouts.items()
        }

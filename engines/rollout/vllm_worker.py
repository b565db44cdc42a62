"""The vLLM side of the rollout engine: methods mixed into vLLM's worker class (`worker_extension_cls`), run in
vLLM's worker process through `collective_rpc`: weight loading (layerwise reload, from shared-memory files, from
CUDA IPC buckets of a colocated trainer, or from the trainer's broadcast group), KV cache release on CPU, memory
figures. vllm is imported lazily.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlstages.engines.base import NamedTensors
from rlstages.engines.sync.shm_files import read_bucket


def _storages(tensors: Any) -> list[torch.UntypedStorage]:
    """Distinct storages under a (nested list of) KV cache tensors."""
    out: dict[int, torch.UntypedStorage] = {}
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            out.setdefault(storage.data_ptr(), storage)
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return list(out.values())


class RolloutWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); its methods run via `collective_rpc`.

    `self` is the vLLM worker (`self.model_runner`, `self.vllm_config`). Runs in the worker process only.
    """

    model_runner: Any
    vllm_config: Any

    def rls_packed_modules(self) -> dict[str, list[str]]:
        """The model's fused-layer map, e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}."""
        mapping = getattr(self.model_runner.get_model(), "packed_modules_mapping", {}) or {}
        return {k: list(v) for k, v in mapping.items()}

    def rls_begin_weight_update(self) -> None:
        """Start a layerwise reload: layers are rebuilt and re-processed as their weights arrive."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # A partial update leaves most layers untouched; vLLM warns for each of them at finish.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def rls_load_weights_file(self, path: str) -> int:
        """Load one bucket of HF-named tensors with the model's own `load_weights`; returns its size."""
        weights = read_bucket(path)
        self.rls_load(weights)
        return len(weights)

    def rls_load_ipc(self, message: dict[str, Any]) -> int:
        """Load the tensors of one CUDA IPC push message (`sync.cuda_ipc.receive`: the sender's persistent
        buffer mapped once by its handle, the GPU found by UUID, then views into it); the device is synchronised
        before this answers, so the sender may overwrite the buffer. Returns the number of tensors."""
        from rlstages.engines.sync.cuda_ipc import receive

        return receive(message, self.rls_load)

    def rls_device_uuid(self) -> str | None:
        """The UUID of this worker's GPU (None on CPU): a sync group must not put two ranks on one GPU."""
        device = self.model_runner.device  # the device vLLM placed this worker's model on (not process-wide)
        if device.type != "cuda":
            return None
        from rlstages.engines.sync.cuda_ipc import gpu_uuid

        return gpu_uuid(torch.cuda.current_device() if device.index is None else device.index)

    def rls_load(self, named_tensors: NamedTensors) -> None:
        """HF-named tensors through the model's own `load_weights` (inside a layerwise reload)."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(iter(named_tensors))

    def rls_finish_weight_update(self) -> None:
        """Finish the layerwise reload: untouched layers get their old tensors back."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)

    def rls_join_weight_group(
        self, name: str, addr: str, port: int, rank: int, world: int, timeout: float, shm_path: str | None, host: str
    ) -> None:
        """Join the trainer's weight-sync group at `rank` + this worker's rank."""
        from rlstages.engines.sync.collective.membership import join_group

        rank += int(getattr(self, "rank", 0))
        join_group(name, addr, port, rank, world, timeout, shm_path, host, getattr(self, "device", None))  # vLLM's

    def rls_receive_weights(self, name: str) -> int:
        """Receive the source's buckets into one layerwise reload (a fused layer's parts may arrive in different
        buckets: each layer is processed once all its tensors are in); returns the number of tensors."""
        from rlstages.engines.sync.collective.wire import receive_into

        self.rls_begin_weight_update()
        try:
            return receive_into(_ModelLoader(self), name)
        finally:
            self.rls_finish_weight_update()

    def rls_leave_weight_group(self, name: str) -> None:
        """Forget the sync group `name` in this worker."""
        from rlstages.engines.sync.collective.membership import leave_group

        leave_group(name)

    def rls_release_kv_cache(self) -> int:
        """Free the KV cache storage (tensor objects stay, pointing at empty storage); returns bytes freed."""
        self._rls_kv = [(s, s.nbytes()) for s in _storages(self.model_runner.kv_caches) if s.nbytes()]
        for storage, _ in self._rls_kv:
            storage.resize_(0)
        return sum(n for _, n in self._rls_kv)

    def rls_restore_kv_cache(self) -> int:
        """Re-allocate the KV cache freed by `rls_release_kv_cache`, zeroed; returns bytes allocated."""
        kv = getattr(self, "_rls_kv", [])
        for storage, nbytes in kv:
            storage.resize_(nbytes)
            storage.fill_(0)
        self._rls_kv = []
        return sum(n for _, n in kv)

    def rls_memory(self) -> dict[str, int]:
        """This worker's resident set size and allocated KV cache bytes."""
        import psutil

        kv = sum(s.nbytes() for s in _storages(self.model_runner.kv_caches))
        return {"rss_bytes": psutil.Process().memory_info().rss, "kv_cache_bytes": kv}


class _ModelLoader:
    """What `collective.wire.receive_into` hands buckets to inside a vLLM worker: the model's own `load_weights`."""

    def __init__(self, worker: RolloutWorkerExtension) -> None:
        self.worker = worker

    def update_weights(self, named_tensors: NamedTensors) -> None:
        """Load HF-named tensors (views of the received payload) into the worker's model."""
        self.worker.rls_load(named_tensors)

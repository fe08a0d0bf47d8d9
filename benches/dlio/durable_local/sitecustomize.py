"""Loaded by the DLIO processes of the `local-fsync` checkpoint target
(this directory is put first on their PYTHONPATH): DLIO's PyTorch
checkpoints are fsynced before each file is closed, so local disk pays
for durability as the mount's write-back does (its close returns once
the worker has synced the file). DLIO itself never syncs a checkpoint.

The patch is applied when DLIO imports its checkpointing module, through
an import hook, so nothing else is imported early."""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "dlio_benchmark.checkpointing.pytorch_checkpointing"


def _durable_save_state(self, suffix, state):
    import torch

    name = self.get_name(suffix)
    with open(name, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.PyTorchCheckpointing.save_state = _durable_save_state
            print("lakecache bench: DLIO checkpoints are fsynced at close", flush=True)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())

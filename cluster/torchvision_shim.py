"""Lets PyPI's torchvision import beside CPU torch (copied to site-packages by scripts/setup.sh with a .pth).

PyPI's torchvision wheel is built against CUDA torch; beside the CPU torch wheel its C library fails to load,
which torchvision tolerates, but `torchvision/_meta_registrations.py` then registers fake kernels for the
`nms`/`qnms` ops and fails with "operator torchvision::nms does not exist". transformers' processors and
vLLM's Qwen2-VL path import torchvision. Defining those two op schemas (no kernels) before that module
runs fixes the import; the Python transforms medray uses need no C kernels. A .pth hook reaches vLLM's and
Ray's spawned processes too. It is a no-op wherever torchvision's C library loads (a GPU cluster).
"""
import importlib.abc
import sys

_TARGET = "torchvision._meta_registrations"


def _define_missing_ops():
    import torch
    for op in ("nms", "qnms"):
        try:
            getattr(torch.ops.torchvision, op)
        except (AttributeError, RuntimeError):
            lib = torch.library.Library("torchvision", "FRAGMENT")
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _LIBS.append(lib)  # a Library unregisters its ops when collected


_LIBS: list = []


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == _TARGET:
            sys.meta_path.remove(self)
            import torchvision.extension  # noqa: F401  the C library attempt comes first
            _define_missing_ops()
        return None


def install():
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

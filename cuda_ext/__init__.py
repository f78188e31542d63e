"""CUDA kernels (cupy RawModule) and their loader, installed as ``tiercache.cuda_ext``.

No kernel has landed yet: the data plane's copies use torch (``copy_`` on dedicated streams),
which is also the CPU fallback every future kernel here must keep and be tested against.
"""

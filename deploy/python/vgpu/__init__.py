"""vgpu's helpers for applications that run on a vgpu tenant (see deploy/python/README.md)."""

"""Hot reload: re-execute edited modules in place and keep the program running.

    reloader = Reloader(["tsdev_kernels.ops", "tsdev_runtime.layers"])
    tx = reloader.reload()        # changed modules + dependents, live objects patched
    if tx.report.ok: ...warm up, recapture...; tx.commit()   # or tx.rollback(reason)

See docs/hotreload.md for the contract a server follows. Imports neither the
runtime nor torch/triton: Triton kernels are handled when Triton is loaded.
"""
from .reloader import Plan, Reloader
from .snapshot import DEFAULT_PACKAGES, default_packages, import_roots
from .transaction import ReloadError, Report, Transaction

__all__ = ["DEFAULT_PACKAGES", "Plan", "ReloadError", "Reloader", "Report", "Transaction", "default_packages",
           "import_roots"]

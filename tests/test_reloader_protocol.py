"""tsdev's Reloader is what the engine's reload_forward expects (tsdev_runtime.engine.reload_forward.ForwardReloader):
the runtime never imports the toolkit, so only this test notices when the two drift apart."""
import importlib
import inspect

import pytest

from tsdev_runtime.control_protocol import WorkerReport
from tsdev_runtime.engine.reload_forward import (ForwardReloader, ReloadPlan, ReloadReport, ReloadTransaction,
                                           reported)
from tsdev.hotreload import Reloader
from tsdev.hotreload.reloader import Plan
from tsdev.hotreload.transaction import Report, Transaction


@pytest.mark.parametrize("protocol, implementation", [
    (ForwardReloader, Reloader), (ReloadTransaction, Transaction), (ReloadPlan, Plan), (ReloadReport, Report)])
def test_every_method_exists_and_takes_the_protocols_arguments(protocol, implementation):
    for name, member in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        method = getattr(implementation, name, None)
        assert callable(method), f"{implementation.__name__} lacks {name}()"
        wanted = inspect.signature(member).parameters
        accepted = inspect.signature(method).parameters
        for arg, param in wanted.items():
            assert arg in accepted, f"{implementation.__name__}.{name}() takes no `{arg}` argument"
            if param.default is not inspect.Parameter.empty:  # optional in the protocol: optional here too
                assert accepted[arg].default is not inspect.Parameter.empty, f"{name}({arg}=...) is required"


def test_a_reload_gives_what_reload_forward_reads(package):
    reloader = Reloader(["protopkg"])
    assert isinstance(reloader, ForwardReloader)
    assert "protopkg.a" in reloader.modules()
    (package / "a.py").write_text("class f:\n    pass\n\n\nkeep = f\n")  # a function became a class: stale
    sources = reloader.read_sources()
    plan = reloader.plan(sources=sources, modules=None)
    assert isinstance(plan, ReloadPlan) and list(plan.reloaded) == ["protopkg.a"]
    tx = reloader.reload(modules=None, sources=sources)
    assert isinstance(tx, ReloadTransaction) and isinstance(tx.report, ReloadReport) and tx.report.ok
    worker = WorkerReport(ok=True, **reported(tx.report))
    assert worker.reloaded == ["protopkg.a"] and worker.stale and worker.stale[0].name.endswith("f")
    tx.rollback("the test undoes it")
    assert tx.report.ok is False and importlib.import_module("protopkg.a").f() == 1

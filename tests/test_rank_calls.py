"""Rank 0's rank-wide calls are written out: DrivenRunner has a method for each of RANK_CALLS (the table `follow`
accepts on the other ranks) with the model runner's parameters, plus launch, restore_model and stop, and nothing
else public; RankedReloader has the reloader protocol's methods, no proxy."""
import inspect

from tsdev_runtime.engine.model_runner import ModelRunner
from tsdev_runtime.engine.ranks import RANK_CALLS, DrivenRunner, RankedReloader
from tsdev_runtime.engine.reload_forward import ForwardReloader


def public(cls) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_driven_runner_has_a_method_per_rank_call_with_the_runners_parameters():
    assert public(DrivenRunner) == set(RANK_CALLS) | {"launch", "restore_model", "stop"}
    for call in [*RANK_CALLS, "launch", "restore_model"]:
        driven = list(inspect.signature(getattr(DrivenRunner, call)).parameters)
        runner = list(inspect.signature(getattr(ModelRunner, call)).parameters)
        assert driven == runner, (call, driven, runner)
    assert not hasattr(DrivenRunner, "__getattr__")


def test_ranked_reloader_writes_out_the_reloader_protocol():
    protocol = {name for name in vars(ForwardReloader)
                if not name.startswith("_") and callable(vars(ForwardReloader)[name])}
    assert protocol <= public(RankedReloader)
    assert "__getattr__" not in vars(RankedReloader)

"""The reload's transaction loop (runtime/tsdev_runtime/engine/steps.py): steps run in order and are timed; a failure leaves the
steps begun -- the failed one too -- to be undone last first, guards included, each undo told why."""
import asyncio

import pytest

from tsdev_runtime.engine.steps import Step, Steps


def test_a_failure_undoes_the_steps_begun_last_first_and_the_guard_after_the_step_it_guards():
    done, events = [], []

    def step(name, fail=False):
        async def run():
            done.append(f"run {name}")
            if fail:
                raise RuntimeError(f"{name} broke")
        return run

    def undo(name):
        async def run(why):
            done.append(f"undo {name}: {why}")
        return run

    async def transaction():
        steps = Steps(lambda name, state, fields: events.append((name, state)))
        plan = [Step("drain", step("drain")), Step("graphs", undo=undo("graphs")),
                Step("reload", step("reload"), undo=undo("reload")), Step("recapture", step("recapture", True),
                                                                          undo=undo("recapture")),
                Step("never", step("never"), undo=undo("never"))]
        with pytest.raises(RuntimeError, match="recapture broke"):
            await steps.run(plan)
        assert steps.current == "recapture" and list(steps.timings) == ["drain", "reload", "recapture"]
        await steps.undo("recapture broke")
        await steps.undo("again")  # nothing is undone twice
        return steps

    asyncio.run(transaction())
    assert done == ["run drain", "run reload", "run recapture", "undo recapture: recapture broke",
                    "undo reload: recapture broke", "undo graphs: recapture broke"]
    assert events == [("drain", "started"), ("drain", "done"), ("reload", "started"), ("reload", "done"),
                      ("recapture", "started"), ("recapture", "failed")]  # a guard has no run: no event

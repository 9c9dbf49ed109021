"""The reload's transaction loop (runtime/tsdev_runtime/engine/steps.py): steps run in order and are timed; a failure
leaves the steps begun -- the failed one too -- to be undone last first, guards included, each undo told why."""
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


def test_an_undo_that_raises_is_reported_and_the_undos_after_it_still_run():
    """The graphs guard's undo (recapture with the old code) ran only if every undo before it returned: one that
    raised left the graphs on freed memory and the client a 500. Each undo is guarded now."""
    done = []

    async def run():
        pass

    async def broken(why):
        raise ValueError("the old model is gone")

    async def recorded(why):
        done.append(why)

    async def fail():
        raise RuntimeError("warm broke")

    async def transaction():
        steps = Steps()
        with pytest.raises(RuntimeError):
            await steps.run([Step("graphs", undo=recorded), Step("reload", run, undo=broken), Step("warm", fail)])
        return await steps.undo("warm broke")

    failures = asyncio.run(transaction())
    assert done == ["warm broke"]  # the guard's undo ran after the failed one
    assert len(failures) == 1 and failures[0].startswith("reload: ") and "the old model is gone" in failures[0]

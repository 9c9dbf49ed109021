"""One owner of control (issue 70, point 1): `LLMEngine` keeps the requests and the steps, and its `control`
(runtime/tsdev_runtime/engine/control.py) holds the state, the lock, the calls every rank makes and every operation
that pauses serving. Read from the sources (nothing is built): the engine stays within nano-vllm's size, and no
control operation comes back onto it, nor onto the step loop, as a pass-through."""
import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "runtime" / "tsdev_runtime" / "engine"
MAX_METHODS, MAX_LINES = 20, 300
# what pauses serving or changes what the server is doing: the control's, and nobody else's
OPERATIONS = {"pause", "continue_generation", "flush_prefix_cache", "sleep", "wake_up", "update_weights",
              "weights_checksum", "reload_forward", "free_memory", "restore_memory", "load_weights", "checksum",
              "capture_graphs", "capture_next", "hold", "drain", "set", "phase", "cannot_step"}
STATE = {"state", "ranked", "ranks", "weights_dir", "control_lock", "paused", "holding", "refusing", "weights_loaded"}


def class_of(module: str, name: str) -> ast.ClassDef:
    tree = ast.parse((ENGINE / module).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def attributes(cls: ast.ClassDef) -> set[str]:
    """The `self.x` a class assigns anywhere."""
    return {target.attr for node in ast.walk(cls) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for target in (target.elts if isinstance(target, ast.Tuple) else [target])
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}


def test_llm_engine_keeps_requests_and_steps_in_at_most_20_methods_and_300_lines():
    engine = class_of("llm_engine.py", "LLMEngine")
    lines = engine.end_lineno - engine.lineno + 1
    assert len(methods(engine)) <= MAX_METHODS, sorted(methods(engine))
    assert lines <= MAX_LINES, f"LLMEngine has {lines} lines"


def test_every_control_operation_and_the_state_are_the_controls_alone():
    control = class_of("control.py", "EngineControl")
    assert OPERATIONS <= methods(control), OPERATIONS - methods(control)
    assert {"paused", "holding", "stopping", "refusing", "weights_loaded", "lock", "ranked", "ranks",
            "weights_dir"} <= attributes(control)
    for module, name in (("llm_engine.py", "LLMEngine"), ("async_engine.py", "AsyncEngine")):
        cls = class_of(module, name)
        assert not OPERATIONS & methods(cls), (name, OPERATIONS & methods(cls))
        assert not STATE & attributes(cls), (name, STATE & attributes(cls))

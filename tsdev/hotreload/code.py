"""Two questions the patcher and the CuTe DSL's stale-kernel check both ask, with nothing of either: do two code
objects behave the same, and where do some objects live."""
import types


def same_code(a: types.CodeType, b: types.CodeType, skip: frozenset[str] = frozenset()) -> bool:
    """Same behaviour: equal bytecode, names and constants; line numbers may differ (an edit above moved it).
    Nested code objects whose qualname is in `skip` may differ (kernel bodies: Triton compiles their source)."""
    if a is b:
        return True
    if (a.co_code != b.co_code or a.co_names != b.co_names or a.co_varnames != b.co_varnames
            or a.co_freevars != b.co_freevars or a.co_cellvars != b.co_cellvars or a.co_argcount != b.co_argcount
            or a.co_kwonlyargcount != b.co_kwonlyargcount or a.co_flags != b.co_flags
            or len(a.co_consts) != len(b.co_consts)):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) and isinstance(y, types.CodeType):
            if not ((x.co_qualname == y.co_qualname and x.co_qualname in skip) or same_code(x, y, skip)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def instance_paths(instances: list, modules: list[types.ModuleType], limit: int = 5) -> list[str]:
    """Where some of `instances` live, found cheaply: module globals, their attributes, nn.Module children."""
    wanted = {id(x) for x in instances}
    paths: list[str] = []
    for module in modules:
        for key, value in list(vars(module).items()):
            if isinstance(value, (types.ModuleType, type, types.FunctionType)) or key.startswith("__"):
                continue
            base = f"{module.__name__}.{key}"
            if id(value) in wanted:
                paths.append(base)
            children = getattr(value, "_modules", None)
            if isinstance(children, dict) and hasattr(value, "named_modules"):
                paths += [f"{base}.{n}" for n, m in value.named_modules() if n and id(m) in wanted]
            elif isinstance(getattr(value, "__dict__", None), dict):
                paths += [f"{base}.{k}" for k, v in vars(value).items() if id(v) in wanted]
            if len(paths) >= limit:
                return sorted(paths)[:limit]
    return sorted(paths)

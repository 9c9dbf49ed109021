"""The serving runtime. Importing it checks that `import kernels` finds this project's kernels package."""
import importlib.util
from pathlib import Path


def _check_kernels_package() -> None:
    """Hugging Face's `kernels` package (a dependency of transformers from 5.25) has the same top-level name as
    this project's kernels: where it comes first on sys.path, every kernel import would reach it instead."""
    ours = Path(__file__).resolve().parent.parent / "kernels"
    spec = importlib.util.find_spec("kernels")
    found = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    if found != ours:
        raise ImportError(
            f"`import kernels` finds {found or 'nothing'}, not tsdev's kernels package ({ours}). Hugging Face's "
            "`kernels` package (installed with transformers >= 5.25) has the same name: use an environment "
            "without it (`pip uninstall kernels` and `pip install 'transformers<5.25'`), or run from the "
            "repository's root, where tsdev's comes first.")


_check_kernels_package()

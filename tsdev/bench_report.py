"""The bench result as a rich table, with the change against a baseline run."""
from rich.console import Group
from rich.table import Table
from rich.text import Text

# metric, label, unit, better when higher
ROWS = [
    ("successful_requests", "Successful requests", "", True),
    ("failed_requests", "Failed requests", "", False),
    ("duration_s", "Duration", "s", False),
    ("request_throughput", "Request throughput", "req/s", True),
    ("input_throughput", "Input token throughput", "tok/s", True),
    ("output_throughput", "Output token throughput", "tok/s", True),
    ("total_throughput", "Total token throughput", "tok/s", True),
] + [(f"{stat}_{name}", f"{stat.capitalize()} {label}", "ms", False)
     for name, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))
     for stat in ("mean", "median", "p90", "p99")] + [
    ("client_cpu_ms_per_request", "Client CPU per request", "ms", False),
]


def render(result: dict, baseline: dict | None = None) -> Group:
    metrics = result["metrics"]
    table = Table(title=f"tsdev bench: {result['model']} ({result['config']['endpoint']}, "
                        f"{result['config']['num_prompts']} requests)", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    if baseline:
        table.add_column("baseline", justify="right")
        table.add_column("change", justify="right")
    for key, label, unit, higher_is_better in ROWS:
        value = metrics.get(key)
        row = [f"{label}" + (f" ({unit})" if unit else ""), _fmt(value)]
        if baseline:
            old = baseline["metrics"].get(key)
            row += [_fmt(old), _change(value, old, higher_is_better)]
        table.add_row(*row)
    parts = [table]
    if result.get("errors"):
        errors = Text(f"{metrics['failed_requests']} request(s) failed; first errors:\n", style="red")
        for error in result["errors"][:5]:
            errors.append(f"  {error}\n")
        parts.append(errors)
    return Group(*parts)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if isinstance(value, int) or abs(value) >= 1000 else f"{value:,.2f}"


def _change(new, old, higher_is_better: bool) -> Text:
    if new is None or old is None or old == 0:
        return Text("-")
    delta = (new - old) / abs(old) * 100
    better = (delta > 0) == higher_is_better
    return Text(f"{delta:+.1f}%", style="dim" if abs(delta) < 1 else ("green" if better else "red"))

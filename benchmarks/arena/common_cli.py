"""The text of `--list`: tasks with their descriptions and default variants, then every variant."""

from __future__ import annotations

from .tasks import task
from .variants import TASK_NAMES, VARIANTS, for_task


def describe() -> str:
    lines = ["tasks:"]
    for name in TASK_NAMES:
        module = task(name)
        budget = f" (budget {module.DEFAULT_BUDGET})" if module.DEFAULT_BUDGET else ""
        lines.append(f"  {name:<14} {module.DESCRIPTION}{budget}")
        lines.append(f"  {'':<14} variants: {', '.join(for_task(name)) or '-'}")
    lines.append("variants:")
    for name, v in VARIANTS.items():
        keywords = ", ".join(f"{k}={val!r}" for k, val in {**v.layers, **v.wrapper}.items()) or "defaults"
        env = "".join(f" [{k}={val}]" for k, val in v.env.items())
        lines.append(f"  {name:<14} {v.summary} ({v.paper}); {keywords}{env}")
    return "\n".join(lines)

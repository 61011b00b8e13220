"""A budget policy for Outrigger, written in Python and built with componentize-py.

Before a model call is sent, the sidecar asks the budget hook whether the call may
go ahead. This policy projects the task's usage with the call added (tokens, cost,
one more call) and compares every limit the task has:

* past ``downgrade_at`` of any limit (default 0.8), the call is moved to the
  cheapest model the sidecar offers as a downgrade, if one is cheaper than the call
  as asked;
* past ``reject_at`` of a limit (default 1.0), the call is refused and the reason
  names the limit, unless moving it to the cheapest model keeps every limit within
  ``reject_at`` (a cost limit usually: a cheaper model costs less, the same tokens);
* otherwise the call is admitted as asked.

"Past" is strict: exactly 80 % of a limit is admitted, exactly 100 % is not
refused. A limit of 0 is passed by any use at all. Without a cheaper model on offer, a call
between the two thresholds is admitted and the policy logs a warning. "Cheaper" is
the call's own estimate on the offered model against its estimate as asked: the
sidecar offers the same models for every call, so some may cost more than the one
asked for (a free local model, say), and a call asked at no cost has nothing cheaper.

Parameters (strings in the sidecar's config, ``params`` of the binding):
``downgrade_at`` (0.8) and ``reject_at`` (1.0), shares of a limit.

The decision is the plain function ``decide``; the ``Budget`` class only reads the
parameters and converts the answer into the WIT types.
"""

import math
from typing import List, Optional, Tuple

from wit_world import exports
from wit_world.imports import host, types

DEFAULT_DOWNGRADE_AT = 0.8
DEFAULT_REJECT_AT = 1.0

# (limit name, units used after this call, the limit, unit)
Check = Tuple[str, int, int, str]


def share_param(name: str, default: float) -> float:
    """A share parameter from config; a value that does not parse keeps the default."""
    raw = host.param(name)
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        host.log(
            host.Level.WARN,
            f"parameter {name}={raw!r} is not a share (0.8 means 80 %); using {default}",
        )
        return default
    return value


def checks(request: types.BudgetRequest, call_cost_micros: int) -> List[Check]:
    """Every limit the task has, with the task's usage once this call is counted."""
    usage, limits = request.usage, request.limits
    tokens_in = usage.tokens_in + request.estimated_tokens_in
    tokens_out = usage.tokens_out + request.estimated_tokens_out
    projected = [
        ("tokens_in", tokens_in, limits.tokens_in, "tokens"),
        ("tokens_out", tokens_out, limits.tokens_out, "tokens"),
        ("tokens_total", tokens_in + tokens_out, limits.tokens_total, "tokens"),
        ("cost", usage.cost_micros + call_cost_micros, limits.cost_micros, "micro-dollars"),
        # Wall-clock time is not spent by the call before it is sent.
        ("wall_clock", usage.wall_clock_ms, limits.wall_clock_ms, "ms"),
        ("calls", usage.calls + 1, limits.calls, "calls"),
        ("retries", usage.retries, limits.retries, "retries"),
    ]
    return [(name, used, limit, unit) for name, used, limit, unit in projected if limit is not None]


def share(used: int, limit: int) -> float:
    """How much of a limit is used, 1.0 meaning all of it."""
    if limit == 0:
        return 0.0 if used == 0 else math.inf
    return used / limit


def first_past(projection: List[Check], threshold: float) -> Optional[Check]:
    """The first limit used beyond ``threshold`` of it, if any."""
    for check in projection:
        if share(check[1], check[2]) > threshold:
            return check
    return None


def cheapest(request: types.BudgetRequest) -> Optional[types.DowngradeOption]:
    """The offered model on which the call costs least, if that is less than it costs as
    asked; a tie goes to the lower price (input plus output), then to the first listed."""
    offered = [
        o
        for o in request.downgrades
        if o.model != request.model and cost_on(request, o) < request.estimated_cost_micros
    ]
    if not offered:
        return None
    return min(
        offered,
        key=lambda o: (cost_on(request, o), o.cost_per_mtok_in + o.cost_per_mtok_out),
    )


def cost_on(request: types.BudgetRequest, option: types.DowngradeOption) -> int:
    """The call's estimated cost on ``option``, in micro-dollars."""
    return (
        request.estimated_tokens_in * option.cost_per_mtok_in
        + request.estimated_tokens_out * option.cost_per_mtok_out
    ) // 1_000_000


def reason(check: Check) -> str:
    name, used, limit, unit = check
    if limit == 0:
        return f"{name} limit: the task may use no {unit}, and this call would use {used}"
    percent = math.floor(used * 100 / limit)
    return (
        f"{name} limit: this call would bring the task to {used} of {limit} {unit} "
        f"({percent} %)"
    )


def decide(
    request: types.BudgetRequest, downgrade_at: float, reject_at: float
) -> types.BudgetDecision:
    """Admit, downgrade or reject one call."""
    as_asked = checks(request, request.estimated_cost_micros)
    if first_past(as_asked, min(downgrade_at, reject_at)) is None:
        return types.BudgetDecision_Admit()

    option = cheapest(request)
    if option is None:
        over = first_past(as_asked, reject_at)
        if over is not None:
            return types.BudgetDecision_Reject(reason(over))
        host.log(
            host.Level.WARN,
            f"task {host.task_id() or '-'} is near its budget and no cheaper model is offered",
        )
        return types.BudgetDecision_Admit()

    over = first_past(checks(request, cost_on(request, option)), reject_at)
    if over is not None:
        return types.BudgetDecision_Reject(reason(over))
    return types.BudgetDecision_Downgrade(option.model)


# Parameters are fixed for an instance's life (new params make a new version), so
# they are read through the host on the first call only.
_thresholds: Optional[Tuple[float, float]] = None


class Budget(exports.Budget):
    """The budget hook: the class componentize-py looks for, named after the interface."""

    def admit(self, request: types.BudgetRequest) -> types.BudgetDecision:
        global _thresholds
        if _thresholds is None:
            _thresholds = (
                share_param("downgrade_at", DEFAULT_DOWNGRADE_AT),
                share_param("reject_at", DEFAULT_REJECT_AT),
            )
        downgrade_at, reject_at = _thresholds
        return decide(request, downgrade_at, reject_at)

"""Declarative benchmark cases.

A case names the contenders it compares and how to build them; the runner
(``benchmarks.run``) does the timing, statistics and reporting::

    @register(
        "my_case",
        description="what is compared, at which sizes",
        config={"batch": 8, "seq": 1024},        # defaults
        quick={"batch": 2, "seq": 128},           # overrides for --quick
        scenarios={"forward": {"mode": "forward"},  # one table row each
                   "fwd+bwd": {"mode": "train"}},
        baseline="torch",                         # ratios are X / torch
    )
    def setup(config: dict) -> dict[str, Callable[[], None]]:
        ...                                      # build inputs and modules
        return {"ours": step_ours, "torch": step_torch}

``setup`` is called once per scenario with the merged config (defaults <
scenario < quick < command line) and returns zero-argument step functions,
one per contender, that each run one measured unit of work (e.g. one
forward pass). It should also check, before returning, that the contenders
compute the same thing, so two different computations are never timed.

Timing keys the runner reads from the config (all optional):
``warmup`` (alternating warm-up rounds), ``rounds`` (measured rounds),
``number`` (calls per measurement, the time is divided by it) and
``threads`` (``torch.set_num_threads``; None keeps torch's default) and
``device`` ("cuda": the clock is read after ``torch.cuda.synchronize()``).

``setup`` may return a :class:`Contenders` instead of a plain dict, to say
which contenders it could not time and why (a peer that is not installed,
one whose outputs differ, one that does not apply to the scenario), how
many FLOPs one step does (the runner then reports FLOP/s) and any other
figures measured during setup (e.g. peak memory); the runner records them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CASES", "TIMING_DEFAULTS", "Case", "Contenders", "load_cases", "register"]

Step = Callable[[], None]
Setup = Callable[[dict[str, Any]], dict[str, Step]]

TIMING_DEFAULTS: dict[str, Any] = {"warmup": 3, "rounds": 20, "number": 1, "threads": None}


class Contenders(dict):
    """``{contender name: step}`` plus what the runner records beside the times.

    Attributes:
        not_timed: name -> (status, reason) of a contender left out, status
            one of "missing" (an optional peer not installed), "refused"
            (its outputs differ from the others'), "n/a" (it cannot run this
            scenario), "failed" (its first call raised, e.g. no kernel).
        flops: name -> FLOPs of one step (the useful work of the scenario,
            the same for every contender computing the same thing).
        notes: name -> {figure: value} measured during setup (e.g. peak
            memory in MiB), recorded in the JSON and the report.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.not_timed: dict[str, tuple[str, str]] = {}
        self.flops: dict[str, float] = {}
        self.notes: dict[str, dict[str, Any]] = {}


@dataclass(frozen=True)
class Case:
    """One benchmark: contenders built by ``setup`` and timed per scenario.

    Attributes:
        name: identifier used on the command line and in result file names.
        description: one or two sentences for ``--list`` and the report.
        setup: ``setup(config) -> {contender name: zero-arg step function}``.
        config: default configuration (sizes, dtype, timing keys).
        quick: overrides applied by ``--quick`` (a smoke run of seconds).
        scenarios: named config overrides; each is timed separately and is
            one row (per contender) of the report. ``{"default": {}}`` when
            a case has a single setting.
        baseline: the contender other contenders are divided by in ratios
            (None: the first contender ``setup`` returns).
        subject: when set, ratios are ``subject / contender`` for every
            other contender (one row per peer, the subject's time over the
            peer's), instead of ``contender / baseline``.
    """

    name: str
    description: str
    setup: Setup
    config: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)
    scenarios: dict[str, dict[str, Any]] = field(default_factory=lambda: {"default": {}})
    baseline: str | None = None
    subject: str | None = None

    def resolve(
        self, scenario: str, *, quick: bool = False, overrides: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The effective config of one scenario: timing defaults < case
        defaults < scenario < quick < ``overrides`` (command line)."""
        if scenario not in self.scenarios:
            raise KeyError(f"case {self.name!r} has no scenario {scenario!r}; valid: {list(self.scenarios)}")
        config = {**TIMING_DEFAULTS, **self.config, **self.scenarios[scenario]}
        if quick:
            config.update(self.quick)
        config.update(overrides or {})
        return config


CASES: dict[str, Case] = {}


def register(
    name: str,
    *,
    description: str,
    config: dict[str, Any] | None = None,
    quick: dict[str, Any] | None = None,
    scenarios: dict[str, dict[str, Any]] | None = None,
    baseline: str | None = None,
    subject: str | None = None,
) -> Callable[[Setup], Setup]:
    """Decorator: register ``setup`` as the case ``name`` in ``CASES``.

    Raises:
        ValueError: a case of that name is already registered.
    """

    def decorate(setup: Setup) -> Setup:
        if name in CASES:
            raise ValueError(f"benchmark case {name!r} is registered twice")
        CASES[name] = Case(
            name=name,
            description=description,
            setup=setup,
            config=dict(config or {}),
            quick=dict(quick or {}),
            scenarios=dict(scenarios or {"default": {}}),
            baseline=baseline,
            subject=subject,
        )
        return setup

    return decorate


def load_cases() -> dict[str, Case]:
    """Import every module in ``benchmarks.cases`` (which registers them)."""
    import importlib
    import pkgutil

    from . import cases

    for info in pkgutil.iter_modules(cases.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{cases.__name__}.{info.name}")
    return CASES

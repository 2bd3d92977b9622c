"""The cache's settings: `CacheConfig`, the one declaration of every cache setting (its default,
bounds and help), and `Budget`, its slot counts once resolved for a prompt.

A setting is a dataclass field made by `setting()`: its metadata holds the help text, the label
the page shows and the bounds or choices, which `check_fields` enforces. The command line, the
`/v1` API and the page read them from here (`APP_FIELDS` are the ones a user of the app sets), so
a setting is described once.
"""

import math
import numbers
from dataclasses import dataclass, field, fields
from fractions import Fraction
from functools import cached_property

POLICIES = ("full", "window", "sink", "h2o")
SCORES = ("sum", "mean", "decay")
POSITIONS = ("absolute", "rolling")
BUDGET_SHAPES = ("uniform", "pyramid")
# PyramidKV's beta: the top layer keeps 1/beta of the average layer's heavy slots (their default, 20;
# at least 1, so the top layer is the smallest and every layer keeps a heavy slot)
PYRAMID_BETA = 20
KV_QUANTS = ("none", "int8")


def setting(default, help, label=None, choices=None, low=None, high=None, low_open=False, integer=False):
    """A dataclass field with its help text, page label and bounds (see check_fields)."""
    return field(default=default, metadata=dict(help=help, label=label, choices=choices, low=low, high=high,
                                                low_open=low_open, integer=integer))


class SettingError(ValueError):
    """A setting refused: `name` is its field ("max_new_tokens"), `rule` what it must be ("must be at
    least 1, got -5"). It reads as a sentence with the setting in words ("max new tokens must be at
    least 1, got -5"); a caller with its own names for the fields (the API's max_tokens) says
    f"{its name} {rule}"."""

    def __init__(self, name, rule, words=None):
        super().__init__(f"{words or name} {rule}")
        self.name, self.rule = name, rule


def in_words(f):
    """A settings field's name as a sentence says it: its page label without the note
    ("Budget (slots)" -> "budget", "Max new tokens" -> "max new tokens"), else its name spaced."""
    label = (f.metadata.get("label") or f.name.replace("_", " ")).split(" (")[0]
    return label[:1].lower() + label[1:]


def bounds_rule(low=None, high=None, low_open=False):
    """What a number within the bounds must be, in words: "must be at least 1", "must be from 0 to 5",
    "must be more than 0 and at most 1"."""
    above = f"more than {low}" if low_open else f"at least {low}"
    if high is None:
        return f"must be {above}"
    if low is None:
        return f"must be at most {high}"
    return f"must be {above} and at most {high}" if low_open else f"must be from {low} to {high}"


def check_number(name, value, low=None, high=None, integer=False, low_open=False, words=None):
    """A real number (bools, text, NaN refused) within [low, high] ((low, high] with low_open); a
    whole one when `integer`, returned as an int. SettingError naming `name` (said as `words`) otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise SettingError(name, f"must be a number, got {value!r}", words)
    if integer:
        if not isinstance(value, numbers.Integral) and not float(value).is_integer():
            raise SettingError(name, f"must be a whole number, got {value!r}", words)
        value = int(value)
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        raise SettingError(name, f"{bounds_rule(low, high, low_open)}, got {value!r}", words)
    return value


def check_fields(obj, names=None):
    """Check (and normalise: whole floats of integer fields become ints) the fields of the
    dataclass `obj` that declare choices or bounds; `names` limits it to those. A number out of its
    bounds is a SettingError that says the field in words."""
    for f in fields(obj):
        meta, value = f.metadata, getattr(obj, f.name)
        if not meta or (names is not None and f.name not in names) or value is None and f.default is None:
            continue
        if meta["choices"] is not None:
            if value not in meta["choices"]:
                raise ValueError(f"unknown {f.name} {value!r}; choose one of {', '.join(meta['choices'])}")
        elif meta["low"] is not None or meta["high"] is not None or meta["integer"]:
            setattr(obj, f.name, check_number(f.name, value, meta["low"], meta["high"], meta["integer"],
                                              meta["low_open"], in_words(f)))


def nearest_allowed(cls, values):
    """(`cls`(...), [what was changed]) for the settings dataclass `cls` from `values`, a dict of its
    fields that may hold what `cls` refuses (a file written by an older version or by hand). A
    number out of its declared bounds becomes the nearest bound (a whole one for an integer
    field); anything else a field refuses, and an unknown field, gives way to its default; a
    combination `cls` refuses (sinks and recent window over the budget) gives up the one field,
    the last declared first, whose default makes it work. Changes read "budget 0 -> 512"."""
    known = {f.name: f for f in fields(cls)}
    kept, changed = {}, [f"{name} {value!r} dropped (no such setting)" for name, value in values.items()
                         if name not in known]
    for name in (f.name for f in fields(cls) if f.name in values):  # in declaration order
        value = values[name]
        kept[name] = _nearest_value(known[name], value)
        if kept[name] is not value and kept[name] != value:
            changed.append(f"{name} {value!r} -> {kept[name]!r}")
    tries = [kept] + [{k: v for k, v in kept.items() if k != name} for name in reversed(kept)] + [{}]
    for values_tried in tries:
        try:
            made = cls(**values_tried)
        except (TypeError, ValueError):
            continue
        changed += [f"{name} {kept[name]!r} -> {getattr(made, name)!r}" for name in kept if name not in values_tried]
        return made, changed
    raise AssertionError(f"{cls.__name__}'s defaults are refused")  # never: the defaults are valid


def _nearest_value(f, value):
    """The value of field `f` nearest `value` that its declaration allows (its default if none is near)."""
    meta = f.metadata
    if not meta or (value is None and f.default is None):
        return value
    if meta["choices"] is not None:
        return value if value in meta["choices"] else f.default
    if meta["low"] is None and meta["high"] is None and not meta["integer"]:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        return f.default
    if meta["integer"] and math.isfinite(value):
        value = round(value)
    if meta["high"] is not None and value > meta["high"]:
        return meta["high"]
    if meta["low"] is not None and (value <= meta["low"] if meta["low_open"] else value < meta["low"]):
        return f.default if meta["low_open"] else meta["low"]
    return value


def _is_fraction(x) -> bool:
    return isinstance(x, float) and 0.0 < x < 1.0


@dataclass
class CacheConfig:
    """How an `H2OCache` evicts: the one declaration of every cache setting and its default.

    Budgets count slots per layer and KV head: a bounded layer's keys and values are
    `[batch, kv_heads, slots, head_dim]` with `slots <= budget`. Every setting is checked on
    construction; a bad one raises `ValueError` naming it, before any model is touched.

    Parameters
    ----------
    policy : {"h2o", "sink", "window", "full"}, default "h2o"
        What fills the budget: heavy hitters and the recent window (`h2o`); the sinks and the
        newest tokens (`sink`, StreamingLLM); the newest tokens only (`window`); everything
        (`full`, never evicts).
    budget : int or float, default 512
        Total slots per layer and KV head (int), or a fraction in (0, 1) of the first prompt's
        length, as in the paper's experiments ("20%" is `budget=0.2`). A float that is a whole
        number is taken as that int.
    n_sink : int, default 4
        The first tokens, always kept (StreamingLLM's attention sinks; 0 is the paper's H2O).
        Ignored by `window`.
    n_recent : int, float or None, default None
        The newest tokens, always kept. None: half of what the sinks leave for `h2o` (the
        paper's equal heavy/recent split), all of it for `sink` and `window`. A fraction only
        when `budget` is one too.
    score : {"sum", "mean", "decay"}, default "sum"
        How attention mass adds up into a token's score: summed (the paper); divided by the
        number of queries that could see the token (old tokens are not favoured for being old);
        exponentially decayed (each new query first multiplies the old mass by `decay`).
    decay : float, default 0.9
        The factor of `score="decay"`, in (0, 1].
    positions : {"rolling", "absolute"}, default "rolling"
        `absolute` keeps each key at the RoPE position it was written with (the paper's real
        drop); `rolling` re-rotates kept keys to contiguous positions ending right before the
        next query whenever the oldest falls twice the budget behind, so no distance exceeds
        2 x budget and a chat can outlive the model's trained context.
    prefill_chunk : int, default 256
        A long input is attended in chunks of this many tokens, evicting after each, so scoring
        never builds a `[heads, n, n]` matrix for the whole prompt.
    budget_shape : {"uniform", "pyramid"}, default "uniform"
        How the model's slots (layers x budget) are shared between its layers: `uniform`, the
        budget in every layer; `pyramid` (PyramidKV), every layer keeps the sinks and the recent
        window, and the heavy-hitter slots fall linearly from the bottom layer to the top one
        (`layer_budgets`), the total unchanged.
    keep_template : bool, default False
        Never evict the chat template's control tokens (role markers, turn ends) of any turn: the
        chat layer pins them (chat/template.py's `template_ranges`); they count against the budget
        as pins do, so a long chat's grow until the budget has no room and a turn is refused.
        Off by default: measured on dialogue, it did not help (docs/story-fidelity.md).
    kv_quant : {"none", "int8"}, default "none"
        How keys and values are stored: at the model's width, or as int8 codes with a float32
        scale and zero point per token and head, float16 (136 bytes where bf16 takes 256 at head_dim 64).
        See cache/kv_int8.py.

    Raises
    ------
    ValueError
        An unknown choice; a `SettingError` (a ValueError naming the setting in words) for a budget
        that is not positive (or not a number), negative counts, `n_sink + n_recent` over an
        int budget, or a pyramid with no heavy-hitter slot to share.
    """

    policy: str = setting("h2o", "h2o: heavy hitters + newest; sink: sinks + newest (StreamingLLM); window: newest "
                          "only; full: never evict", label="Policy", choices=POLICIES)
    budget: int | float = setting(512, "KV slots per layer and KV head", label="Budget (slots)")
    n_sink: int = setting(4, "first tokens always kept (attention sinks)", label="Sinks", low=0, integer=True)
    n_recent: int | float | None = setting(None, "newest tokens always kept (default: for h2o half of what the sinks "
                                           "leave, for sink and window all of it)", label="Recent window (blank = auto)", low=0)
    score: str = setting("sum", "a token's attention, summed (the paper), per query that saw it (mean), or decayed",
                         label="Score", choices=SCORES)
    decay: float = setting(0.9, "the factor of score='decay'", low=0, high=1, low_open=True)
    positions: str = setting("rolling", "rolling re-lays kept keys so a chat outlives the model's context; absolute "
                             "keeps them where written", label="Positions", choices=POSITIONS)
    prefill_chunk: int = setting(256, "long inputs are attended in chunks of this many tokens", low=1, integer=True)
    budget_shape: str = setting("uniform", "uniform: the budget in every layer; pyramid: more heavy-hitter slots in "
                                "lower layers, fewer in upper ones, the same total (PyramidKV)", label="Budget shape",
                                choices=BUDGET_SHAPES)
    keep_template: bool = setting(False, "never evict the chat template's control tokens (role markers, turn ends) of "
                                  "any turn; they count against the budget, as pins do", label="Keep template tokens")
    kv_quant: str = setting("none", "keys and values at the model's width (none), or int8 with a scale and zero "
                            "point per token and head: 136 bytes where bf16 takes 256, a small error",
                            label="KV storage", choices=KV_QUANTS)

    def __post_init__(self):
        check_fields(self)
        if not isinstance(self.keep_template, bool):
            raise SettingError("keep_template", f"must be true or false, got {self.keep_template!r}",
                               "keep template tokens")
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise SettingError("budget", f"must be a number of slots or a fraction in (0, 1), got {b!r}")
        if b <= 0:
            raise SettingError("budget", f"must be positive, got {b!r}")
        if isinstance(b, float):
            if b.is_integer():
                self.budget = b = int(b)
            elif not _is_fraction(b):
                raise SettingError("budget", f"must be a whole number of slots or a fraction in (0, 1), got {b!r}")
        r = self.n_recent
        if isinstance(r, float) and not (_is_fraction(r) and _is_fraction(b)):
            raise SettingError("n_recent", f"may be a fraction only when the budget is one too, got {r!r}",
                               "the recent window")
        if isinstance(b, int) and self.policy != "full" and self.n_sink_effective + (r or 0) > b:
            held = f"{self.n_sink_effective} sinks" + ("" if r is None else f" and a recent window of {r}")
            raise SettingError("budget", f"({b}) cannot hold {held}", "the budget")
        if isinstance(b, int):
            self.resolve(0, n_layers=2)  # a pyramid with nothing to share is refused now, not at the first input

    @property
    def n_sink_effective(self) -> int:
        return 0 if self.policy == "window" else self.n_sink

    def resolve(self, prompt_len: int, n_layers: int | None = None) -> "Budget":
        """The budgets in slots.

        Parameters
        ----------
        prompt_len : int
            The first prompt's length in tokens: what fractional budgets are taken of.
        n_layers : int, optional
            The model's layers, which `budget_shape` shares the slots between (None: the
            average layer's budget only, as a table labels it).

        Returns
        -------
        Budget
            `budget` (None for `full`), `n_sink` and `n_recent` in slots; `n_heavy` is the rest;
            `layers`, each layer's budget when they differ.

        Raises
        ------
        SettingError
            A pyramid whose average layer has no heavy-hitter slot to share.
        """
        if self.policy == "full":
            return Budget(budget=None, n_sink=0, n_recent=0)
        budget = self.budget
        if _is_fraction(budget):
            budget = max(1, round(budget * prompt_len))
        n_sink = min(self.n_sink_effective, budget)
        if self.n_recent is None:
            n_recent = (budget - n_sink + 1) // 2 if self.policy == "h2o" else budget - n_sink
        elif _is_fraction(self.n_recent):
            n_recent = round(self.n_recent * prompt_len)
        else:
            n_recent = self.n_recent
        n_recent = min(n_recent, budget - n_sink)
        layers = None
        if self.budget_shape != "uniform" and n_layers is not None:
            layers = layer_budgets(budget, n_sink, n_recent, n_layers)
        return Budget(budget=budget, n_sink=n_sink, n_recent=n_recent, layers=layers)


def layer_budgets(budget, n_sink, n_recent, n_layers):
    """PyramidKV's budgets: [n_layers] ints, bottom layer first, summing to n_layers * budget.

    Every layer keeps `n_sink + n_recent` (the window a layer needs to read the newest text at
    all, as PyramidKV keeps its observation window in every layer); the heavy-hitter slots
    h = budget - n_sink - n_recent per layer fall linearly from 2h - h/beta at the bottom to
    h/beta (at least 1) at the top, so their mean stays h. Why: lower layers spread attention
    over much of the text, upper ones concentrate it on a few tokens (PyramidKV's "pyramidal
    information funneling"), so a few heavy hitters serve an upper layer as well as many.
    Exact fractions, then the largest remainders (the lower layer first on a tie) round to whole
    slots without changing the sum. SettingError when h < 1: the top layer would be left with
    no slot beyond its sinks and recent window."""
    heavy = budget - n_sink - n_recent
    if heavy < 1:
        raise SettingError("budget_shape", f"'pyramid' needs heavy-hitter slots to share between layers, but a budget "
                           f"of {budget} with {n_sink} sinks and a recent window of {n_recent} leaves none: raise the "
                           "budget or lower the recent window", "the budget shape")
    if n_layers == 1:
        return (budget,)
    top = max(Fraction(1), Fraction(heavy, PYRAMID_BETA))
    bottom = 2 * heavy - top
    exact = [bottom - (bottom - top) * i / (n_layers - 1) for i in range(n_layers)]
    whole = [math.floor(x) for x in exact]
    for i in sorted(range(n_layers), key=lambda i: (whole[i] - exact[i], i))[: heavy * n_layers - sum(whole)]:
        whole[i] += 1
    return tuple(n_sink + n_recent + h for h in whole)


@dataclass(frozen=True)
class Budget:
    """Resolved slot counts per layer and KV head; `budget` None means unbounded (policy "full").
    `layers`: each layer's budget when they differ (budget_shape "pyramid"), summing to layers x
    `budget`; None when every layer has `budget`. Every layer has the same sinks and recent window."""

    budget: int | None
    n_sink: int
    n_recent: int
    layers: tuple[int, ...] | None = None

    @property
    def n_heavy(self) -> int:
        return 0 if self.budget is None else self.budget - self.n_sink - self.n_recent

    def layer(self, i) -> "Budget":
        """Layer i's limits: this Budget itself when every layer has the same."""
        return self if self.layers is None else self._per_layer[i]

    @cached_property
    def _per_layer(self):
        return tuple(Budget(b, self.n_sink, self.n_recent) for b in self.layers)

    @property
    def tightest(self) -> "Budget":
        """The limits of the layer with the fewest slots: what a pin must fit (it takes a slot in every layer)."""
        return self if self.layers is None else Budget(min(self.layers), self.n_sink, self.n_recent)


# The settings a user of the app changes (its flags, the page's Cache fields, the API's "h2o" object);
# decay and prefill_chunk stay the library's.
APP_FIELDS = ("policy", "budget", "n_recent", "n_sink", "score", "positions", "keep_template", "kv_quant")

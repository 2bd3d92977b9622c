"""The cache's settings: `CacheConfig`, the one declaration of every cache setting and its
default, and `Budget`, its slot counts once resolved for a prompt."""

from dataclasses import dataclass

POLICIES = ("full", "window", "sink", "h2o")
SCORES = ("sum", "mean", "decay")
POSITIONS = ("absolute", "rolling")


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

    Raises
    ------
    ValueError
        An unknown choice, a budget that is not positive (or not a number), negative counts, or
        `n_sink + n_recent` over an int budget.
    """

    policy: str = "h2o"
    budget: int | float = 512
    n_sink: int = 4
    n_recent: int | float | None = None
    score: str = "sum"
    decay: float = 0.9
    positions: str = "rolling"
    prefill_chunk: int = 256

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"H2OCache: {msg}")

        if self.policy not in POLICIES:
            bad(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.score not in SCORES:
            bad(f"unknown score {self.score!r}; choose one of {', '.join(SCORES)}")
        if self.positions not in POSITIONS:
            bad(f"unknown positions {self.positions!r}; choose one of {', '.join(POSITIONS)}")
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            bad(f"budget must be a number of slots or a fraction in (0, 1), got {b!r}")
        if b <= 0:
            bad(f"budget must be positive, got {b!r}")
        if isinstance(b, float):
            if b.is_integer():
                self.budget = b = int(b)
            elif not _is_fraction(b):
                bad(f"budget must be a whole number of slots or a fraction in (0, 1), got {b!r}")
        for name in ("n_sink", "prefill_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                bad(f"{name} must be a non-negative integer, got {v!r}")
        if self.prefill_chunk < 1:
            bad("prefill_chunk must be at least 1")
        r = self.n_recent
        if r is not None:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or r < 0:
                bad(f"n_recent must be a non-negative number, got {r!r}")
            if isinstance(r, float) and not (_is_fraction(r) and _is_fraction(b)):
                bad(f"n_recent may be a fraction only when budget is one too, got {r!r}")
        if isinstance(b, int) and self.policy != "full" and self.n_sink_effective + (r or 0) > b:
            bad(f"n_sink + n_recent ({self.n_sink_effective} + {r}) exceeds the budget ({b})")
        if not (0.0 < self.decay <= 1.0):
            bad(f"decay must be in (0, 1], got {self.decay!r}")

    @property
    def n_sink_effective(self) -> int:
        return 0 if self.policy == "window" else self.n_sink

    def resolve(self, prompt_len: int) -> "Budget":
        """The budgets in slots.

        Parameters
        ----------
        prompt_len : int
            The first prompt's length in tokens: what fractional budgets are taken of.

        Returns
        -------
        Budget
            `budget` (None for `full`), `n_sink` and `n_recent` in slots; `n_heavy` is the rest.
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
        return Budget(budget=budget, n_sink=n_sink, n_recent=n_recent)


@dataclass(frozen=True)
class Budget:
    """Resolved slot counts; `budget` None means unbounded (policy "full")."""

    budget: int | None
    n_sink: int
    n_recent: int

    @property
    def n_heavy(self) -> int:
        return 0 if self.budget is None else self.budget - self.n_sink - self.n_recent

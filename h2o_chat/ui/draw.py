"""Drawing the panel from the ledger: the token map (HTML), the retention map (a PNG), the legend,
stats and chart rows (`panel` draws them all).

Everything here is plain Python data and strings; the UI never sees a tensor. Colours are from
the Okabe-Ito palette (distinguishable with the common colour-vision deficiencies), and every
status also differs in shape (border, underline, strike-through), not in hue alone.

A view is chosen by (layer, head): (None, None) is every layer and KV head, (layer, None) every
KV head of one layer, (layer, head) exactly one head's slots. The token map, the counts and the
heavy-hitter table all read the same view.
"""

import base64
import html
import io

import torch
from PIL import Image

from ..cache.config import CacheConfig
from ..models.quantize import weights_label

# status -> colour; strength (the share of the view's heads keeping the token) sets opacity
COLORS = {"sink": "#CC79A7", "pinned": "#009E73", "heavy": "#E69F00", "kept": "#F0E442",
          "recent": "#56B4E9", "evicted": "#999999"}
SHOWN = ("sink", "pinned", "heavy", "recent", "kept", "evicted")
# what each policy keeps, in the words the legend uses; every sentence fits its policy
POLICY_TEXT = {
    "h2o": ("H2O keeps, in every layer and KV head, the first tokens (sinks), the newest ones (recent) and "
            "the few that have drawn the most attention (heavy hitters), and evicts the rest: memory stays "
            "bounded however long the chat runs."),
    "sink": ("StreamingLLM (sink) keeps the first tokens (sinks) and the newest ones (recent) and evicts "
             "everything in between: memory stays bounded however long the chat runs."),
    "window": ("A sliding window keeps only the newest tokens (recent) and evicts the rest: memory stays "
               "bounded however long the chat runs."),
    "full": "A full cache keeps every token: nothing is evicted and memory grows with the chat.",
}
STATUS_TEXT = {"sink": "first tokens, always kept", "pinned": "a pinned message, never evicted",
               "heavy": "kept for its attention score", "recent": "the newest tokens",
               "kept": "held, not (yet) for its score", "evicted": "no longer in the view's cache"}
FOLD_RUN = 24  # evicted runs longer than this are folded to their ends
FOLD_KEEP = 6
MAP_COLUMNS = 600  # the retention map bins longer chats into this many columns
# A view of all heads, or of a layer's, can keep up to layers x heads x budget tokens: drawn whole,
# a 35,000-token story's map was 4.3 MB of HTML and seconds of a page open. Such views draw the
# newest MAP_NEWEST tokens and count the earlier ones; one head's view keeps at most its budget,
# so it is drawn whole.
MAP_NEWEST = 4096
MAP_ROW_PX = 6


def _hex_to_rgb(color):
    return tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))


def view_of(retention, layer=None, head=None):
    """The (layer, head) pairs a view covers: kept and score as [pairs, tokens]."""
    kept, score = retention["kept"], retention["score"]
    if layer is not None:
        kept, score = kept[layer : layer + 1], score[layer : layer + 1]
        if head is not None:
            kept, score = kept[:, head : head + 1], score[:, head : head + 1]
    return kept.flatten(0, 1), score.flatten(0, 1)


def token_statuses(retention, layer=None, head=None):
    """Per token (status, strength). One head: its exact set (strength 1). Several heads: a
    token kept by fewer than half of them shows as "kept" (a few heads hold it), so the heavy
    hitters most heads agree on stand out instead of the union over every head."""
    kept, _ = view_of(retention, layer, head)
    share = kept.float().mean(dim=0).tolist()
    out = []
    for status, s in zip(retention["status"], share):
        if s == 0:
            out.append(("evicted", 0.0))
        elif status == "heavy" and s < 0.5:
            out.append(("kept", s))
        else:
            out.append((status if status != "evicted" else "kept", s))
    return out


def _span(index, piece, status, strength, title):
    r, g, b = _hex_to_rgb(COLORS[status])
    alpha = 0.0 if status == "evicted" else 0.25 + 0.75 * strength
    text = html.escape(piece).replace("\n", "↵\n")
    return (f'<span class="tok st-{status}" data-i="{index}" style="background:rgba({r},{g},{b},{alpha:.2f})" '
            f'title="{html.escape(title)}">{text}</span>')


def caption(layer=None, head=None, n_layers=None, n_heads=None):
    if layer is None:
        return "All layers and KV heads: a token's strength is the share of heads that keep it."
    if head is None:
        return f"Layer {layer}, all {n_heads or ''} KV heads: a token's strength is the share of this layer's heads that keep it."
    return f"Layer {layer}, KV head {head}: exactly the tokens this head keeps."


def token_map(ledger, retention, layer=None, head=None):
    """The conversation's tokens in order, coloured by status in the chosen view; long evicted
    runs folded, and in a view of more than one head only the newest MAP_NEWEST tokens drawn. Draws the tokens the retention was read for (the ledger may have grown since:
    a reply streaming in another thread while a tab re-renders its panel)."""
    statuses = token_statuses(retention, layer, head)
    kept, score = view_of(retention, layer, head)
    n_pairs = kept.shape[0]
    kept_by = kept.sum(dim=0)
    mean_score = (score.sum(dim=0) / kept_by.clamp(min=1)).tolist()
    kept_by = kept_by.tolist()
    parts, i, n = [], 0, len(statuses)
    if head is None and n > MAP_NEWEST:
        i = n - MAP_NEWEST
        n_kept = sum(status != "evicted" for status, _ in statuses[:i])
        parts.append(f'<span class="fold" title="tokens 0-{i - 1}"> ⋯ {i:,} earlier tokens, {n_kept:,} of them '
                     f'kept: pick a layer and KV head to see which ⋯ </span>')
    while i < n:
        j = i
        while j < n and statuses[j][0] == "evicted":
            j += 1
        if j - i > FOLD_RUN:
            hidden = j - i - 2 * FOLD_KEEP
            parts += [_token(ledger, t, statuses[t], kept_by[t], n_pairs, mean_score[t]) for t in range(i, i + FOLD_KEEP)]
            parts.append(f'<span class="fold" title="tokens {i + FOLD_KEEP}-{j - FOLD_KEEP - 1}">'
                         f' ⋯ {hidden:,} evicted tokens ⋯ </span>')
            parts += [_token(ledger, t, statuses[t], kept_by[t], n_pairs, mean_score[t]) for t in range(j - FOLD_KEEP, j)]
            i = j
            continue
        parts.append(_token(ledger, i, statuses[i], kept_by[i], n_pairs, mean_score[i]))
        i += 1
    n_heads = retention["kept"].shape[1]
    return (f'<p class="map-caption">{caption(layer, head, n_heads=n_heads)}</p>'
            f'<div class="token-map">{"".join(parts)}</div>')


def _token(ledger, t, status_strength, kept_by, n_pairs, score):
    status, _ = status_strength
    title = (f"token {t} · turn {ledger.turns[t]} · {ledger.roles[t]} · {status} · "
             f"kept by {int(kept_by)}/{n_pairs} heads · score {score:.3g}")
    return _span(t, ledger.pieces[t], status, status_strength[1], title)


def shown_statuses(policy):
    """The statuses a policy can show: no "heavy" without scores, no "sink" in a window."""
    return {"h2o": SHOWN, "sink": ("sink", "pinned", "recent", "kept", "evicted"),
            "window": ("pinned", "recent", "kept", "evicted"), "full": ("sink", "pinned", "kept")}.get(policy, SHOWN)


def legend_html(policy=CacheConfig.policy):
    items = "".join(f'<span class="tok st-{s}" style="background:{COLORS[s]}55" title="{STATUS_TEXT[s]}">{s}</span> '
                    for s in shown_statuses(policy))
    return f'<div class="legend"><p>{html.escape(POLICY_TEXT.get(policy, POLICY_TEXT["h2o"]))}</p>{items}</div>'


def retention_png(retention, columns=MAP_COLUMNS):
    """The layers x token-position map as PNG bytes: row = layer (0 at the top), column = token
    (binned to `columns` when longer), colour = the token's status in the token map's colours,
    its strength = the share of that layer's KV heads keeping it (white: none). Sinks show as a
    solid column at the left, the recent window as a solid band at the right, heavy hitters as
    sparse stripes in between, pinned messages as solid bands."""
    share = retention["kept"].float().mean(dim=1)  # [layers, tokens]
    ink = torch.tensor([_hex_to_rgb(COLORS[s]) for s in retention["status"]], dtype=torch.float32)  # [tokens, 3]
    rgb = 255 - share[..., None] * (255 - ink)  # [layers, tokens, 3]: white (no head) -> the status colour (all)
    n_layers, n = share.shape
    if n > columns:  # mean over equal bins of tokens: a bin's colour is its tokens' average
        edges = torch.linspace(0, n, columns + 1).round().long()
        sums = torch.nn.functional.pad(rgb.cumsum(dim=1), (0, 0, 1, 0))
        rgb = (sums[:, edges[1:]] - sums[:, edges[:-1]]) / (edges[1:] - edges[:-1]).clamp(min=1)[:, None]
    rgb = rgb.repeat_interleave(MAP_ROW_PX, dim=0).round().to(torch.uint8)
    image = Image.frombytes("RGB", (rgb.shape[1], rgb.shape[0]), rgb.contiguous().numpy().tobytes())
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def retention_map_html(retention, layer=None):
    """The retention map with its axes named; the chosen layer is marked."""
    n_layers, _, n = retention["kept"].shape
    data = base64.b64encode(retention_png(retention)).decode()
    mark = ""
    if layer is not None:
        top = 100 * layer / n_layers
        mark = f'<div class="rmap-mark" style="top:{top:.2f}%;height:{100 / n_layers:.2f}%"></div>'
    return (f'<div class="rmap"><p class="map-caption">Share of KV heads keeping each token, by layer: white '
            f'none, full colour all; the colours are the token map\'s</p><div class="rmap-body"><span class="rmap-y">layer 0 → {n_layers - 1}</span>'
            f'<div class="rmap-img"><img alt="retention map: layers by token position" src="data:image/png;base64,{data}">'
            f'{mark}</div></div><p class="rmap-x">token position 0 → {max(n - 1, 0):,}</p></div>')


HEAVY_COLUMNS = ["token", "index", "turn", "score", "heads"]  # the heavy-hitter table's, in order


def top_heavy(ledger, retention, layer=None, head=None, k=10):
    """The k tokens with the highest mean score over the view's heads that keep them (outside
    sinks and the recent window): rows for a table."""
    kept, score = view_of(retention, layer, head)
    kept_by = kept.sum(dim=0)
    mean_score = score.sum(dim=0) / kept_by.clamp(min=1)
    candidates = [t for t, s in enumerate(retention["status"]) if s in ("heavy", "kept", "pinned") and kept_by[t]]
    candidates.sort(key=lambda t: float(mean_score[t]), reverse=True)
    visible = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥"})
    return [{"token": ledger.pieces[t].translate(visible), "index": t, "turn": ledger.turns[t],
             "score": round(float(mean_score[t]), 3), "heads": f"{int(kept_by[t])}/{kept.shape[0]}"}
            for t in candidates[:k]]


SERIES = ("this cache", "a full cache")


def memory_rows(stats, budget):
    """Chart rows: slots per KV head and KV MiB against tokens seen, for this cache and for a full
    one, exact at every token seen. A bounded cache takes one slot per token until its budget and
    then holds it: a straight line to the knee at (budget, budget), flat after it; a full cache
    grows with every token. So the rows are the breakpoints, the origin, the knee and now (read
    off the cache: its slots and bytes), drawn from the tokens seen and the budget alone: the
    first reply already shows the knee, and a replay redraws the whole history, not just since.
    stats: ChatSession.stats; budget: slots per head (None: never evicts), or each layer's when
    they differ (budget_shape): a knee per layer, the slots per head their mean."""
    n = stats["tokens_seen"]
    if n == 0:
        return []
    per_token = stats["full_kv_bytes"] / n  # a token's keys and values in every layer and KV head
    # this cache's slot: the same at the model's width, about half of it for int8 slots
    per_slot = stats["kv_bytes"] / stats["slots_used"] if stats["slots_used"] else per_token
    budgets = budget if isinstance(budget, tuple) else (budget,)
    xs = sorted({0, n} | {b for b in budgets if b is not None and b < n})
    rows = []
    for x in xs:
        held = x if budget is None else sum(min(x, b) for b in budgets) / len(budgets)  # slots per head, mean
        slots = int(held)
        kv = stats["kv_bytes"] if x == n else held * per_slot
        if x == n:
            slots = stats["slots_used"]
        rows.append({"tokens seen": x, "cache": SERIES[0], "KV MiB": round(kv / 2**20, 3), "slots per head": slots})
        rows.append({"tokens seen": x, "cache": SERIES[1], "KV MiB": round(x * per_token / 2**20, 3),
                     "slots per head": x})
    return rows


def chart_limits(rows, column):
    """Axis ranges that start at 0 and leave room above the largest value, so one point shows
    as a point on a readable scale instead of raw ticks around it."""
    top = max((r[column] for r in rows), default=0)
    return [0, top * 1.15 if top > 0 else 1]


def slot_counts(retention, layer=None, head=None):
    """{status: slots}: what a KV head of the view holds in its slots, on average over the view's
    heads (one head: exactly its own), by the token's status; the counts add up to the slots each
    head holds (the budget, once it is full). Whole numbers, rounded so that they still do."""
    kept, _ = view_of(retention, layer, head)  # [heads in the view, tokens]
    per_head = kept.float().mean(dim=0).tolist()  # a token's slots per head, on average: the share holding it
    found = {}
    for status, slots in zip(retention["status"], per_head):
        if slots:
            found[status] = found.get(status, 0.0) + slots
    return apportion(found)


def apportion(amounts):
    """{key: float} -> {key: int} adding up to the rounded total (largest remainders first)."""
    whole = {k: int(v) for k, v in amounts.items()}
    short = round(sum(amounts.values())) - sum(whole.values())
    for k in sorted(amounts, key=lambda k: amounts[k] - whole[k], reverse=True)[:max(short, 0)]:
        whole[k] += 1
    return {k: v for k, v in whole.items() if v}


def kept_anywhere(retention, layer=None, head=None):
    """(tokens some head of the view keeps, tokens none keeps)."""
    kept, _ = view_of(retention, layer, head)
    some = int(kept.any(dim=0).sum())
    return some, kept.shape[1] - some


def seconds(s):
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def stats_markdown(stats, retention, layer=None, head=None, live=None, weights=None):
    """The stats line. live: (ttft_s, tokens_per_s) of the reply streaming now, shown instead
    of the last finished turn's. weights: which weights run (models.quantize.weights_label)."""
    saved = 1 - stats["kv_bytes"] / stats["full_kv_bytes"] if stats["full_kv_bytes"] else 0.0
    ttft, speed = live if live is not None else (stats["ttft_s"], stats["tokens_per_s"])
    full_width = "" if stats["kv_width"] == stats["model_width"] else f" in {stats['model_width']}"  # said once when the same
    timing = ("no reply yet since it was opened" if live is None and ttft is None else
              "TTFT … · waiting for the first token" if ttft is None else
              f"TTFT {seconds(ttft)} · {speed:.1f} tokens/s" if speed is not None else f"TTFT {seconds(ttft)}")
    if live is not None and ttft is not None:
        timing += " · streaming"  # the figures of a reply still being written (the finished line has none)
    return (f"**{stats['tokens_seen']:,}** tokens seen · **{stats['slots_used']:,}** slots per head · "
            f"KV **{stats['kv_bytes'] / 2**20:.1f} MiB** in {stats['kv_width']} (a full cache: "
            f"{stats['full_kv_bytes'] / 2**20:.1f} MiB{full_width}, {saved:.0%} saved) · {timing}" + (f" · weights {weights}" if weights else "")
            + f" · {stats['step']} step"
            + f"\n\n{view_counts(retention, layer, head)}")


def view_counts(retention, layer=None, head=None):
    """What the view's caches hold, counted two ways a reader can check: a KV head's slots by
    status (they add up to its slots), and the tokens some head keeps or none does."""
    slots = slot_counts(retention, layer, head)
    held = " · ".join(f"{slots[s]:,} {s}" for s in SHOWN if slots.get(s))
    some, none = kept_anywhere(retention, layer, head)
    if head is not None:
        return (f"In layer {layer}, head {head}: its {sum(slots.values()):,} slots hold {held or 'nothing yet'}; "
                f"{none:,} tokens evicted")
    where = "all layers and heads" if layer is None else f"layer {layer}"
    return (f"In {where}: each KV head's {sum(slots.values()):,} slots hold on average {held or 'nothing yet'}; "
            f"{some:,} tokens are kept by at least one head, {none:,} by none")


def pins_note(session, retention):
    """What the stats say of the pins (the Chatbot cannot mark a user message): " · pinned (never
    evicted): message 1, the system prompt". It is read off the cache, never assumed: a pinned
    message that some layer or KV head lacks a token of is named apart, with how many are missing."""
    kept, n = retention["kept"], retention["kept"].shape[2]
    whole, broken = [], []
    for start, end in session.cache.pins:
        if start >= n:
            continue  # not fed yet
        system = start == 0 and session.settings.system_prompt_pinned
        name = "the system prompt" if system else f"message {session.ledger.turns[start] + 1}"
        missing = int((~kept[:, :, start : min(end, n)]).sum())
        (broken if missing else whole).append((name, missing))
    note = " · pinned (never evicted): " + ", ".join(name for name, _ in whole) if whole else ""
    if broken:
        note += " · pinned, not whole: " + ", ".join(f"{name} ({missing:,} layer/head/token entries missing)"
                                                     for name, missing in broken)
    return note


def panel(session, layer=None, head=None, live=None, maps=True):
    """Everything the panel shows for a session, drawn as strings and plain rows (no tensors).
    The charts are drawn from the cache's budget and the tokens seen now (memory_rows).
    maps=False leaves the token map and the retention map empty: the costly parts on a long chat,
    not needed to draw the charts alone."""
    retention = session.ledger.retention(session.cache)
    stats, limits = session.stats, session.cache.limits
    return {"token_map": token_map(session.ledger, retention, layer, head) if maps else "",
            "retention_map": retention_map_html(retention, layer) if maps else "",
            "stats": stats_markdown(stats, retention, layer, head, live, weights_label(session.model))
                     + pins_note(session, retention),
            "memory": memory_rows(stats, None if limits is None else limits.layers or limits.budget),
            "heavy": top_heavy(session.ledger, retention, layer, head),
            "legend": legend_html(session.cache_config.policy)}

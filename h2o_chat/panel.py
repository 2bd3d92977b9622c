"""Ledger -> what the UI shows: the token map (HTML), the legend, stats and chart rows.

Everything here is plain Python data and strings; the UI never sees a tensor. Colours are from
the Okabe-Ito palette (distinguishable with the common colour-vision deficiencies), and every
status also differs in shape (border, underline, strike-through), not in hue alone.
"""

import html

# status -> (colour, CSS class); strength (the share of (layer, head) pairs keeping the token) sets opacity
COLORS = {"sink": "#CC79A7", "pinned": "#009E73", "heavy": "#E69F00", "kept": "#F0E442",
          "recent": "#56B4E9", "evicted": "#999999"}
LEGEND = ("H2O keeps, in every layer and attention head, the few tokens that have drawn the most "
          "attention (heavy hitters) plus the newest ones, and evicts the rest: memory stays bounded "
          "however long the chat runs.")
FOLD_RUN = 24  # evicted runs longer than this are folded to their ends
FOLD_KEEP = 6


def _hex_to_rgb(color):
    return tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))


def _span(index, piece, status, strength, title):
    r, g, b = _hex_to_rgb(COLORS[status])
    alpha = 0.0 if status == "evicted" else 0.25 + 0.75 * strength
    text = html.escape(piece).replace("\n", "↵\n")
    return (f'<span class="tok st-{status}" data-i="{index}" style="background:rgba({r},{g},{b},{alpha:.2f})" '
            f'title="{html.escape(title)}">{text}</span>')


def token_statuses(retention, layer=None, head=None):
    """Per token (status, strength): the summary over all (layer, head) pairs, or one head's
    exact set when layer and head are given."""
    status, fraction = retention["status"], retention["fraction"].tolist()
    if layer is None or head is None:
        return list(zip(status, fraction))
    kept = retention["kept"][layer, head].tolist()
    return [(s if k else "evicted", 1.0 if k else 0.0) for s, k in zip(status, kept)]


def token_map(ledger, retention, layer=None, head=None):
    """The conversation's tokens in order, coloured by status; long evicted runs folded."""
    statuses = token_statuses(retention, layer, head)
    n_pairs = retention["kept"].shape[0] * retention["kept"].shape[1]
    kept_by = retention["kept"].sum(dim=(0, 1)).tolist()
    score = retention["score"].sum(dim=(0, 1)) / retention["kept"].sum(dim=(0, 1)).clamp(min=1)
    score = score.tolist()
    # the tokens the retention was read for: the ledger may have grown since (a reply streaming
    # in another thread while a tab re-renders its panel)
    parts, i, n = [], 0, len(statuses)
    while i < n:
        if statuses[i][0] == "evicted":
            j = i
            while j < n and statuses[j][0] == "evicted":
                j += 1
            if j - i > FOLD_RUN:
                for t in list(range(i, i + FOLD_KEEP)) + [None] + list(range(j - FOLD_KEEP, j)):
                    if t is None:
                        hidden = j - i - 2 * FOLD_KEEP
                        parts.append(f'<span class="fold" title="tokens {i + FOLD_KEEP}-{j - FOLD_KEEP - 1}">'
                                     f' ⋯ {hidden:,} evicted tokens ⋯ </span>')
                    else:
                        parts.append(_token(ledger, t, statuses[t], kept_by[t], n_pairs, score[t]))
                i = j
                continue
        parts.append(_token(ledger, i, statuses[i], kept_by[i], n_pairs, score[i]))
        i += 1
    if layer is None or head is None:
        caption = "All layers and KV heads: a token's strength is the share of heads that keep it."
    else:
        caption = f"Layer {layer}, KV head {head}: exactly the tokens this head keeps."
    return f'<p class="map-caption">{caption}</p><div class="token-map">' + "".join(parts) + "</div>"


def _token(ledger, t, status_strength, kept_by, n_pairs, score):
    status, strength = status_strength
    title = (f"token {t} · turn {ledger.turns[t]} · {ledger.roles[t]} · {status} · "
             f"kept by {int(kept_by)}/{n_pairs} heads · score {score:.3g}")
    return _span(t, ledger.pieces[t], status, strength, title)


def legend_html():
    items = "".join(f'<span class="tok st-{s}" style="background:{COLORS[s]}55">{s}</span> '
                    for s in ("sink", "pinned", "heavy", "recent", "kept", "evicted"))
    return f'<div class="legend"><p>{html.escape(LEGEND)}</p>{items}</div>'


def top_heavy(ledger, retention, k=10):
    """The k tokens with the highest mean score over the heads that keep them (outside sinks
    and the recent window): rows for a table."""
    kept = retention["kept"].sum(dim=(0, 1))
    mean_score = retention["score"].sum(dim=(0, 1)) / kept.clamp(min=1)
    candidates = [t for t, s in enumerate(retention["status"]) if s in ("heavy", "kept", "pinned")]
    candidates.sort(key=lambda t: float(mean_score[t]), reverse=True)
    visible = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥"})
    return [{"token": ledger.pieces[t].translate(visible), "index": t, "turn": ledger.turns[t], "score": round(float(mean_score[t]), 3),
             "heads": int(kept[t])} for t in candidates[:k]]


def memory_rows(turn_stats):
    """Chart rows per point (after each reply, and now): slots used and KV MiB (H2O vs a full
    cache) against tokens seen."""
    rows, seen = [], set()
    for s in turn_stats:
        if s["tokens_seen"] in seen:  # "now" when no reply has run since the last point
            continue
        seen.add(s["tokens_seen"])
        rows.append({"tokens_seen": s["tokens_seen"], "series": "H2O cache", "kv_MiB": s["kv_bytes"] / 2**20,
                     "slots": s["slots_used"]})
        rows.append({"tokens_seen": s["tokens_seen"], "series": "full cache", "kv_MiB": s["full_kv_bytes"] / 2**20,
                     "slots": s["tokens_seen"]})
    return rows


def stats_markdown(stats, retention):
    counts = {s: retention["status"].count(s) for s in ("sink", "pinned", "heavy", "kept", "recent", "evicted")}
    kept = ", ".join(f"{n:,} {s}" for s, n in counts.items() if n)
    saved = 1 - stats["kv_bytes"] / stats["full_kv_bytes"] if stats["full_kv_bytes"] else 0.0
    return (f"**{stats['tokens_seen']:,}** tokens seen · **{stats['slots_used']:,}** slots per head · "
            f"KV **{stats['kv_bytes'] / 2**20:.1f} MiB** (a full cache: {stats['full_kv_bytes'] / 2**20:.1f} MiB, "
            f"{saved:.0%} saved) · TTFT {stats['ttft_s']:.2f} s · {stats['tokens_per_s']:.1f} tokens/s\n\n{kept}")


def render(session, layer=None, head=None):
    """Everything the panel shows for a session, as strings and plain rows (no tensors)."""
    retention = session.ledger.retention(session.cache)
    return {"token_map": token_map(session.ledger, retention, layer, head),
            "stats": stats_markdown(session.stats, retention),
            "memory": memory_rows(session.turn_stats + [session.stats]),  # the live point moves as a reply streams
            "heavy": top_heavy(session.ledger, retention)}

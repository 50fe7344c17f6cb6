"""Token inspector helpers: sample lists and the coloured token view (an HTML string, escaped)."""

from __future__ import annotations

import html
import math
from collections.abc import Collection

import numpy as np
import pandas as pd

COLOR_BY = {
    "delta": "Δ = logp after − before (red = fell)",
    "prob_old": "probability before the update (π_old)",
    "prob_new": "probability after the update",
}
SAMPLE_FILTERS = ("all", "correct", "incorrect")
SAMPLE_SORTS = {
    "delta_asc": "largest drop first (Δ < 0)",
    "delta_desc": "largest gain first",
    "index": "sample index",
}


def filter_samples(samples: pd.DataFrame, which: str = "all", sort: str = "delta_asc") -> pd.DataFrame:
    """The step's samples filtered by correctness and sorted (Δ = delta_sum; NULL Δ last)."""
    if samples is None or samples.empty:
        return pd.DataFrame(columns=list(samples.columns) if samples is not None else [])
    df = samples
    if which != "all" and "correct" in df.columns:
        want = which == "correct"
        df = df[df["correct"].fillna(False).astype(bool) == want]
    if sort == "delta_asc" and "delta_sum" in df.columns:
        df = df.sort_values(["delta_sum", "rank", "sample_idx"], na_position="last", kind="stable")
    elif sort == "delta_desc" and "delta_sum" in df.columns:
        df = df.sort_values(["delta_sum", "rank", "sample_idx"], ascending=[False, True, True], na_position="last", kind="stable")
    else:
        df = df.sort_values(["rank", "sample_idx"], kind="stable")
    return df.reset_index(drop=True)


def sample_label(row) -> str:
    d = row.get("delta_sum")
    d_txt = "Δ n/a" if d is None or (isinstance(d, float) and math.isnan(d)) else f"Δ {d:+.3f}"
    ok = row.get("correct")
    verdict = "correct" if ok is True or ok == 1 else ("incorrect" if ok is False or ok == 0 else "?")
    rank = int(row.get("rank", 0) or 0)
    where = f"#{int(row['sample_idx'])}" + (f" (rank {rank})" if rank else "")
    adv = row.get("advantage")
    kept = "" if adv is None or (isinstance(adv, float) and math.isnan(adv)) else (" · preserved" if adv >= 0 else "")
    label = f"{where} · {verdict}{kept} · reward {float(row.get('reward', float('nan'))):.2f} · {d_txt}"
    if row.get("has_tokens") is False or row.get("has_tokens") == 0:
        label += " · no tokens stored"
    return label


def _prob_color(p: float) -> str:
    """Low probability red → high green (HSL hue 0..120), light enough for black text."""
    hue = 120.0 * min(max(p, 0.0), 1.0)
    return f"hsl({hue:.0f}, 75%, 78%)"


def _delta_color(d: float, scale: float) -> str:
    """Δ < 0 red, Δ > 0 blue, white at 0; saturates at ±scale."""
    x = max(-1.0, min(1.0, d / scale)) if scale > 0 else 0.0
    light = 97 - 35 * abs(x)
    hue = 0 if x < 0 else 215
    return f"hsl({hue}, 80%, {light:.0f}%)"


def delta_scale(tokens: pd.DataFrame) -> float:
    d = (tokens["logp_new"].astype("float64") - tokens["logp_old"].astype("float64")).abs().dropna()
    return float(max(0.05, np.quantile(d, 0.95))) if len(d) else 1.0


def _fmt(v) -> str:
    if v is None:
        return "—"
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "—"
    return "—" if math.isnan(f) else f"{f:.4f}"


PENALIZED_STYLE = "outline:2px solid #111;outline-offset:-1px;"  # tokens LLDS would have penalised (whatif)


def token_html(tokens: pd.DataFrame, color_by: str = "prob_old", penalized: Collection[int] | None = None) -> str:
    """The response as coloured token chips.

    - action / answer tokens coloured by `color_by` ("prob_old", "prob_new", "delta"); hover (title) shows
      log-prob before / after / ref, Δ and entropy;
    - tool (observation) tokens grey, italic and unscored;
    - the answer span outlined; every action starts with a small "action k" tag;
    - `penalized` (positions, from `lld-monitor whatif`): those tokens get a dark outline, class lld-penalized.
    All token text is HTML-escaped.
    """
    if tokens is None or tokens.empty:
        return "<div class='lld-tokens'><em>No tokens stored for this sample.</em></div>"
    if color_by not in COLOR_BY:
        raise ValueError(f"color_by must be one of {sorted(COLOR_BY)}, got {color_by!r}")
    t = tokens.sort_values("position")
    scale = delta_scale(t) if color_by == "delta" else 1.0
    parts: list[str] = [
        "<div class='lld-tokens' style='font-family: ui-monospace, monospace; font-size: 13px; line-height: 2.0;"
        " white-space: pre-wrap; word-break: break-word;'>"
    ]
    in_answer = False
    prev_action = None
    prev_role = None
    for row in t.itertuples(index=False):
        role = str(row.role)
        text = html.escape(str(row.token_text if row.token_text is not None else f"<{row.token_id}>"))
        text = text.replace("\n", "↵\n")
        if role != "answer" and in_answer:
            parts.append("</span>")
            in_answer = False
        if role == "tool":
            if prev_role != "tool":
                parts.append("<span style='font-size:10px;color:#777;margin:0 4px;'>[tool]</span>")
            parts.append(
                f"<span title='pos {row.position} · tool/observation token (not scored)'"
                f" style='color:#8a8a8a;background:#eeeeee;font-style:italic;'>{text}</span>"
            )
            prev_role = role
            continue
        aidx = int(row.action_idx) if row.action_idx is not None and not pd.isna(row.action_idx) else -1
        if aidx != prev_action:
            if in_answer:
                parts.append("</span>")
                in_answer = False
            parts.append(
                f"<span style='font-size:10px;color:#1f4e9c;border-left:2px solid #1f4e9c;padding-left:3px;"
                f"margin:0 3px 0 8px;'>action {aidx}</span>"
            )
            prev_action = aidx
        if role == "answer" and not in_answer:
            parts.append("<span class='lld-answer' title='answer span' style='outline:2px solid #2ca02c;"
                         "outline-offset:2px;border-radius:3px;'>")
            in_answer = True
        lo, ln = row.logp_old, row.logp_new
        lo_f = float(lo) if lo is not None and not pd.isna(lo) else math.nan
        ln_f = float(ln) if ln is not None and not pd.isna(ln) else math.nan
        delta = ln_f - lo_f
        if color_by == "delta":
            bg = _delta_color(delta, scale) if not math.isnan(delta) else "#ffffff"
        else:
            v = lo_f if color_by == "prob_old" else ln_f
            bg = _prob_color(math.exp(v)) if not math.isnan(v) else "#ffffff"
        title = (
            f"pos {row.position} · {role} · action {aidx}&#10;"
            f"logp before {_fmt(lo)} (p={_fmt(math.exp(lo_f) if not math.isnan(lo_f) else None)})&#10;"
            f"logp after {_fmt(ln)}&#10;logp ref {_fmt(row.logp_ref)}&#10;"
            f"Δ {_fmt(delta)}&#10;entropy {_fmt(row.entropy)}"
        )
        if penalized is not None and int(row.position) in penalized:
            title += "&#10;LLDS would have penalised this token"
            parts.append(f"<span class='lld-penalized' title='{title}' style='background:{bg};border-radius:2px;"
                         f"{PENALIZED_STYLE}'>{text}</span>")
        else:
            parts.append(f"<span title='{title}' style='background:{bg};border-radius:2px;'>{text}</span>")
        prev_role = role
    if in_answer:
        parts.append("</span>")
    parts.append("</div>")
    return "".join(parts)


def legend_html(color_by: str, scale: float = 1.0, penalized: bool = False) -> str:
    if color_by == "delta":
        stops = [(-scale, _delta_color(-scale, scale)), (0.0, _delta_color(0.0, scale)), (scale, _delta_color(scale, scale))]
        chips = "".join(f"<span style='background:{c};padding:0 6px;margin-right:4px;'>Δ {v:+.2f}</span>" for v, c in stops)
    else:
        chips = "".join(f"<span style='background:{_prob_color(p)};padding:0 6px;margin-right:4px;'>p={p:.2f}</span>"
                        for p in (0.0, 0.25, 0.5, 0.75, 1.0))
    return (f"<div style='font-size:12px;'>{chips}<span style='color:#8a8a8a;background:#eee;font-style:italic;"
            f"padding:0 6px;margin-right:4px;'>tool (unscored)</span><span style='outline:2px solid #2ca02c;"
            f"padding:0 6px;'>answer span</span>"
            + (f"<span style='{PENALIZED_STYLE}padding:0 6px;margin-left:6px;'>LLDS would have penalised</span>"
               if penalized else "") + "</div>")


def token_summary(tokens: pd.DataFrame) -> dict:
    """Counts and sums over one response's scored (action + answer) tokens."""
    if tokens is None or tokens.empty:
        return {"tokens": 0, "scored": 0, "tool": 0, "delta_sum": None, "delta_min": None, "actions": 0}
    scored = tokens[tokens["role"] != "tool"]
    d = (scored["logp_new"].astype("float64") - scored["logp_old"].astype("float64")).dropna()
    return {
        "tokens": int(len(tokens)),
        "scored": int(len(scored)),
        "tool": int((tokens["role"] == "tool").sum()),
        "delta_sum": float(d.sum()) if len(d) else None,
        "delta_min": float(d.min()) if len(d) else None,
        "actions": int(scored["action_idx"].nunique()) if len(scored) else 0,
    }

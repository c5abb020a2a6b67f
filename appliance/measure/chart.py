"""The bench chart: decode tok/s per workload, with and without the draft, as grouped bars in a PNG (Pillow)."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from appliance.system.files import write_atomically

COLORS = ((52, 101, 164), (186, 189, 182))  # with draft, no draft
INK = (46, 52, 54)
GRID = (225, 225, 225)


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _nice_step(top: float) -> float:
    """A round axis step giving 4-8 grid lines up to `top`."""
    raw = top / 5 if top > 0 else 1.0
    power = 10.0 ** math.floor(math.log10(raw))
    return float(next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw))


def draw_bench_chart(
    path: Path,
    title: str,
    rows: Sequence[tuple[str, float | None, float | None]],
    legend: tuple[str, str] = ("with draft", "no draft"),
) -> None:
    """rows: (workload, tok/s with the draft, tok/s without); a missing value draws no bar."""
    width = max(640, 120 + 150 * len(rows))
    height = 480
    left, right, top, bottom = 70, 20, 86, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    title_font, font, small = _font(16), _font(13), _font(11)
    draw.text((left, 14), title, fill=INK, font=title_font)
    for i, label in enumerate(legend):
        x = left + i * 260
        draw.rectangle((x, 42, x + 14, 54), fill=COLORS[i])
        draw.text((x + 20, 40), label, fill=INK, font=small)
    values = [v for _, a, b in rows for v in (a, b) if v is not None]
    step = _nice_step(max(values, default=1.0) * 1.1)
    ceiling = step * math.ceil(max(values, default=1.0) * 1.1 / step)
    plot_h = height - top - bottom

    def y_of(value: float) -> float:
        return height - bottom - plot_h * value / ceiling

    tick = 0.0
    while tick <= ceiling + 1e-9:
        y = y_of(tick)
        draw.line((left, y, width - right, y), fill=GRID)
        draw.text((left - 8, y), f"{tick:g}", fill=INK, font=small, anchor="rm")
        tick += step
    draw.line((left, top, left, height - bottom), fill=INK)
    draw.line((left, height - bottom, width - right, height - bottom), fill=INK)
    draw.text((14, top - 20), "decode tok/s", fill=INK, font=small)
    group = (width - left - right) / max(len(rows), 1)
    bar = min(48.0, group / 3)
    for index, (name, *pair) in enumerate(rows):
        center = left + group * (index + 0.5)
        for j, value in enumerate(pair):
            if value is None:
                continue
            x0 = center - bar + j * bar
            draw.rectangle((x0 + 2, y_of(value), x0 + bar - 2, height - bottom), fill=COLORS[j])
            draw.text((x0 + bar / 2, y_of(value) - 3), f"{value:.0f}", fill=INK, font=small, anchor="md")
        with_draft, without = pair
        label = name if not (with_draft and without) else f"{name}  {with_draft / without:.2f}x"
        draw.text((center, height - bottom + 8), label, fill=INK, font=font, anchor="ma")
    png = io.BytesIO()
    image.save(png, format="PNG")
    write_atomically(path, png.getvalue())  # the one writer: bench often runs as root

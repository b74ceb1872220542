"""Line charts of tokens/s against threads, written as PNG.

The machine the benchmarks run on has no matplotlib, so the chart is drawn
with the standard library alone: a small RGB canvas, lines, a 3x5 bitmap font
for labels, and a PNG encoder (zlib + struct). Where matplotlib is importable
it draws the same chart instead.

Both axes are logarithmic: thread counts double, and tokens/s of models an
order of magnitude apart share a panel. Perfect scaling is a straight line.
"""
from __future__ import annotations

import math
import struct
import zlib

# Each glyph: 5 rows of 3 pixels, top row first. Text is drawn upper-case.
FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001010010",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111", "J": "001001001101010",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    ".": "000000000000010", "-": "000000111000000", "/": "001001010100100", "(": "010100100100010",
    ")": "010001001001010", ":": "000010000010000", "_": "000000000000111", "+": "000010111010000",
    ",": "000000000010100", "=": "000111000111000", "%": "101001010100101", " ": "000000000000000",
}
GLYPH_W, GLYPH_H, SCALE = 3, 5, 2
ADVANCE = (GLYPH_W + 1) * SCALE

WHITE, BLACK, GREY, LIGHT = (255, 255, 255), (0, 0, 0), (110, 110, 110), (225, 225, 225)
PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (23, 190, 207), (188, 189, 34), (127, 127, 127),
           (0, 0, 128), (128, 0, 0)]


class Canvas:
    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.px = bytearray(bytes(WHITE) * (width * height))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        """Filled, corners included."""
        for y in range(max(y0, 0), min(y1, self.h - 1) + 1):
            lo, hi = max(x0, 0), min(x1, self.w - 1)
            if lo <= hi:
                self.px[3 * (y * self.w + lo):3 * (y * self.w + hi + 1)] = bytes(color) * (hi - lo + 1)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, width: int = 1, dash: int = 0) -> None:
        """Bresenham's line, `width` pixels thick; dash > 0 draws dash-long
        pieces with dash-long gaps."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, step, half = dx + dy, 0, width // 2
        while True:
            if not dash or (step // dash) % 2 == 0:
                self.rect(x0 - half, y0 - half, x0 - half + width - 1, y0 - half + width - 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2, step = 2 * err, step + 1
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, color=BLACK) -> None:
        """s with its top-left corner at (x, y); unknown characters are blank."""
        for ch in s.upper():
            bits = FONT.get(ch, FONT[" "])
            for k, bit in enumerate(bits):
                if bit == "1":
                    px, py = x + (k % GLYPH_W) * SCALE, y + (k // GLYPH_W) * SCALE
                    self.rect(px, py, px + SCALE - 1, py + SCALE - 1, color)
            x += ADVANCE

    def png(self) -> bytes:
        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

        row = 3 * self.w
        raw = b"".join(b"\x00" + bytes(self.px[y * row:(y + 1) * row]) for y in range(self.h))
        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def text_width(s: str) -> int:
    return len(s) * ADVANCE - SCALE


def nice_ticks(lo: float, hi: float) -> list:
    """1, 2, 5 times powers of ten within [lo, hi]."""
    ticks = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        ticks += [m * 10.0 ** e for m in (1, 2, 5) if lo <= m * 10.0 ** e <= hi]
    return ticks


def tick_label(v: float) -> str:
    return f"{v:g}" if v < 1 else f"{v:.0f}"


def draw_panel(c: Canvas, box, title: str, xlabel: str, series: list) -> None:
    """One panel of log-log lines inside box = (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = box
    pts = [p for s in series for p in s["points"] if p[1] > 0]
    c.text(x0 + (x1 - x0 - text_width(title)) // 2, y0 - 22, title)
    c.text(x0 + (x1 - x0 - text_width(xlabel)) // 2, y1 + 26, xlabel, GREY)
    if not pts:
        c.text(x0 + 10, (y0 + y1) // 2, "NO DATA", GREY)
        return
    xs = sorted({p[0] for p in pts})
    lx0, lx1 = math.log2(xs[0]), math.log2(xs[-1])
    if lx1 - lx0 < 1e-9:
        lx0, lx1 = lx0 - 1, lx1 + 1
    ly0, ly1 = math.log10(min(p[1] for p in pts)), math.log10(max(p[1] for p in pts))
    pad = max(0.08 * (ly1 - ly0), 0.1)
    ly0, ly1 = ly0 - pad, ly1 + pad
    margin = 14  # keeps end points off the frame

    def to_px(x, y):
        u = (math.log2(x) - lx0) / (lx1 - lx0)
        v = (math.log10(y) - ly0) / (ly1 - ly0)
        return (round(x0 + margin + u * (x1 - x0 - 2 * margin)),
                round(y1 - margin - v * (y1 - y0 - 2 * margin)))

    for t in nice_ticks(10 ** ly0, 10 ** ly1):
        _, py = to_px(xs[0], t)
        c.line(x0, py, x1, py, LIGHT)
        label = tick_label(t)
        c.text(x0 - 6 - text_width(label), py - GLYPH_H * SCALE // 2, label, GREY)
    for x in xs:
        px, _ = to_px(x, 10 ** ly0)
        c.line(px, y0, px, y1, LIGHT)
        c.text(px - text_width(str(x)) // 2, y1 + 8, str(x), GREY)
    for a, b in ((x0, y0), (x1, y1)):
        c.line(x0, b, x1, b, BLACK)
        c.line(a, y0, a, y1, BLACK)
    for s in series:
        line = [to_px(x, y) for x, y in sorted(s["points"]) if y > 0]
        for (ax, ay), (bx, by) in zip(line, line[1:]):
            c.line(ax, ay, bx, by, s["color"], width=2, dash=s.get("dash", 0))
        for px, py in line:
            c.rect(px - 3, py - 3, px + 3, py + 3, s["color"])


def plot_stdlib(path, panels: list, title: str) -> None:
    labels = []
    for p in panels:
        for s in p["series"]:
            if s["label"] not in labels:
                labels.append(s["label"])
    legend_w = 40 + max([text_width(lb) for lb in labels] + [0])
    pw, ph, left, top = 480, 420, 70, 70
    width = left + 2 * (pw + left) + legend_w
    height = max(top + ph + 60, top + 20 * len(labels) + 20)
    c = Canvas(width, height)
    c.text(left, 16, title)
    for i, p in enumerate(panels):
        x0 = left + i * (pw + left)
        draw_panel(c, (x0, top, x0 + pw, top + ph), p["title"], p["xlabel"], p["series"])
    lx, ly = left + 2 * (pw + left) - left // 2, top
    styles = {s["label"]: s for p in panels for s in p["series"]}
    for lb in labels:
        s = styles[lb]
        c.line(lx, ly + 5, lx + 24, ly + 5, s["color"], width=2, dash=s.get("dash", 0))
        c.text(lx + 32, ly, lb)
        ly += 20
    with open(path, "wb") as f:
        f.write(c.png())


LINESTYLES = ["-", ":", ":", ":", "-.", "-.", "--"]  # by dash length, capped at 6


def plot_matplotlib(path, panels: list, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + 3, 5), squeeze=False)
    legend = {}
    for ax, p in zip(axes[0], panels):
        for s in p["series"]:
            pts = sorted(q for q in s["points"] if q[1] > 0)
            ax.plot([q[0] for q in pts], [q[1] for q in pts], marker="s",
                    color=[v / 255 for v in s["color"]], linestyle=LINESTYLES[min(s.get("dash", 0), 6)],
                    label=s["label"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        xs = sorted({q[0] for s in p["series"] for q in s["points"]})
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(p["title"])
        ax.set_xlabel(p["xlabel"])
        ax.grid(True, which="both", alpha=0.3)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend.keys()), loc="center right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(path, panels: list, title: str = "", backend: str = "auto") -> str:
    """Draw panels side by side into the PNG file path; returns the backend used.

    panels: [{"title", "xlabel", "series": [{"label", "points": [(x, y)], "color": (r, g, b),
    "dash": 0 for a solid line, else the length of its dashes in pixels}]}], x and y positive.
    backend: "auto" (matplotlib if importable),
    "matplotlib" or "stdlib"."""
    if backend == "auto":
        try:
            import matplotlib  # noqa: F401
            backend = "matplotlib"
        except ImportError:
            backend = "stdlib"
    (plot_matplotlib if backend == "matplotlib" else plot_stdlib)(path, panels, title)
    return backend

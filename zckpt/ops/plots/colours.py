"""The diff figure's colour scale without matplotlib: matplotlib's ``viridis`` and ``plasma`` (their 256
colours, copied), a log scale over the positive finite values of the grids that share it (``log_range``),
and the colour of each value (``colours``) with matplotlib's conventions: NaN grey (no value), below the
scale white, above it black, else ``lut[floor(256 * t)]`` of the value's place ``t`` on the log scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

import numpy as np

NO_VALUE = "#d0d0d0"
UNCHANGED = "#ffffff"
INFINITE = "#000000"

_LUTS: dict[str, str] = {
    "viridis": (
        "44015444025645045745055946075a46085c460a5d460b5e470d60470e61471063471164471365481467481668481769"
        "48186a481a6c481b6d481c6e481d6f481f70482071482173482374482475482576482677482878482979472a7a472c7a"
        "472d7b472e7c472f7d46307e46327e46337f463480453581453781453882443983443a83443b84433d84433e85423f85"
        "4240864241864142874144874045884046883f47883f48893e49893e4a893e4c8a3d4d8a3d4e8a3c4f8a3c508b3b518b"
        "3b528b3a538b3a548c39558c39568c38588c38598c375a8c375b8d365c8d365d8d355e8d355f8d34608d34618d33628d"
        "33638d32648e32658e31668e31678e31688e30698e306a8e2f6b8e2f6c8e2e6d8e2e6e8e2e6f8e2d708e2d718e2c718e"
        "2c728e2c738e2b748e2b758e2a768e2a778e2a788e29798e297a8e297b8e287c8e287d8e277e8e277f8e27808e26818e"
        "26828e26828e25838e25848e25858e24868e24878e23888e23898e238a8d228b8d228c8d228d8d218e8d218f8d21908d"
        "21918c20928c20928c20938c1f948c1f958b1f968b1f978b1f988b1f998a1f9a8a1e9b8a1e9c891e9d891f9e891f9f88"
        "1fa0881fa1881fa1871fa28720a38620a48621a58521a68522a78522a88423a98324aa8325ab8225ac8226ad8127ad81"
        "28ae8029af7f2ab07f2cb17e2db27d2eb37c2fb47c31b57b32b67a34b67935b77937b87838b9773aba763bbb753dbc74"
        "3fbc7340bd7242be7144bf7046c06f48c16e4ac16d4cc26c4ec36b50c46a52c56954c56856c66758c7655ac8645cc863"
        "5ec96260ca6063cb5f65cb5e67cc5c69cd5b6ccd5a6ece5870cf5773d05675d05477d1537ad1517cd2507fd34e81d34d"
        "84d44b86d54989d5488bd6468ed64590d74393d74195d84098d83e9bd93c9dd93ba0da39a2da37a5db36a8db34aadc32"
        "addc30b0dd2fb2dd2db5de2bb8de29bade28bddf26c0df25c2df23c5e021c8e020cae11fcde11dd0e11cd2e21bd5e21a"
        "d8e219dae319dde318dfe318e2e418e5e419e7e419eae51aece51befe51cf1e51df4e61ef6e620f8e621fbe723fde725"
    ),
    "plasma": (
        "0d088710078813078916078a19068c1b068d1d068e20068f2206902406912605912805922a05932c05942e05952f0596"
        "31059733059735049837049938049a3a049a3c049b3e049c3f049c41049d43039e44039e46039f48039f4903a04b03a1"
        "4c02a14e02a25002a25102a35302a35502a45601a45801a45901a55b01a55c01a65e01a66001a66100a76300a76400a7"
        "6600a76700a86900a86a00a86c00a86e00a86f00a87100a87201a87401a87501a87701a87801a87a02a87b02a87d03a8"
        "7e03a88004a88104a78305a78405a78606a68707a68808a68a09a58b0aa58d0ba58e0ca48f0da4910ea3920fa39410a2"
        "9511a19613a19814a099159f9a169f9c179e9d189d9e199da01a9ca11b9ba21d9aa31e9aa51f99a62098a72197a82296"
        "aa2395ab2494ac2694ad2793ae2892b02991b12a90b22b8fb32c8eb42e8db52f8cb6308bb7318ab83289ba3388bb3488"
        "bc3587bd3786be3885bf3984c03a83c13b82c23c81c33d80c43e7fc5407ec6417dc7427cc8437bc9447aca457acb4679"
        "cc4778cc4977cd4a76ce4b75cf4c74d04d73d14e72d24f71d35171d45270d5536fd5546ed6556dd7566cd8576bd9586a"
        "da5a6ada5b69db5c68dc5d67dd5e66de5f65de6164df6263e06363e16462e26561e26660e3685fe4695ee56a5de56b5d"
        "e66c5ce76e5be76f5ae87059e97158e97257ea7457eb7556eb7655ec7754ed7953ed7a52ee7b51ef7c51ef7e50f07f4f"
        "f0804ef1814df1834cf2844bf3854bf3874af48849f48948f58b47f58c46f68d45f68f44f79044f79143f79342f89441"
        "f89540f9973ff9983ef99a3efa9b3dfa9c3cfa9e3bfb9f3afba139fba238fca338fca537fca636fca835fca934fdab33"
        "fdac33fdae32fdaf31fdb130fdb22ffdb42ffdb52efeb72dfeb82cfeba2cfebb2bfebd2afebe2afec029fdc229fdc328"
        "fdc527fdc627fdc827fdca26fdcb26fccd25fcce25fcd025fcd225fbd324fbd524fbd724fad824fada24f9dc24f9dd25"
        "f8df25f8e125f7e225f7e425f6e626f6e826f5e926f5eb27f4ed27f3ee27f3f027f2f227f1f426f1f525f0f724f0f921"
    ),
}
"""256 colours per map, ``rrggbb`` each, matplotlib 3.11's values rounded to bytes."""


@cache
def lut(name: str) -> np.ndarray:
    """``(256, 3)`` uint8 colours of the map ``name``."""
    return np.frombuffer(bytes.fromhex(_LUTS[name]), dtype=np.uint8).reshape(256, 3)


def rgb(hex_colour: str) -> tuple[int, int, int]:
    h = hex_colour.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def log_range(grids: Sequence[Sequence[Sequence[float]]]) -> tuple[float, float]:
    """``(vmin, vmax)`` of one log scale over the positive finite values of ``grids`` (any when none)."""
    vals = [v for g in grids for row in g for v in row if math.isfinite(v) and v > 0]
    if not vals:
        return 1e-3, 1.0
    lo, hi = min(vals), max(vals)
    return (lo if lo < hi else hi / 10), hi


def colours(values: np.ndarray, lo: float, hi: float, name: str) -> np.ndarray:
    """``(rows, cols, 3)`` uint8 colours of ``values`` on the log scale ``lo..hi`` of map ``name``: 0 white
    (unchanged, below the scale), ``inf`` black, NaN grey, in between the map's colour."""
    v = np.asarray(values, dtype=np.float64)
    out = np.empty((*v.shape, 3), dtype=np.uint8)
    out[...] = rgb(NO_VALUE)
    span = math.log10(hi) - math.log10(lo)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (np.log10(v) - math.log10(lo)) / span * 256
    inside = np.isfinite(t) & (t >= 0) & (t <= 256)
    out[inside] = lut(name)[np.minimum(t[inside].astype(np.int64), 255)]
    out[~np.isnan(v) & (np.nan_to_num(t, nan=0.0, posinf=0.0, neginf=-1.0) < 0)] = rgb(UNCHANGED)
    out[~np.isnan(v) & (t > 256)] = rgb(INFINITE)
    return out


def light(colour: Sequence[int]) -> bool:
    """Whether black text reads better than white on ``colour`` (0..255 RGB)."""
    r, g, b = (c / 255 for c in colour[:3])
    return 0.3 * r + 0.6 * g + 0.1 * b > 0.5

"""Strings that stress a vocabulary's pre-tokenization and merges, for proofs that two
encoders agree (a converted vocabulary and its package's encoder; vLLM's loading of a file
and the file's own library).

Many scripts, combining marks (NFC), digits, whitespace runs and line ends, contractions,
code and emoji; near misses of the common added tokens but none whole.
"""

from __future__ import annotations

import random

STRINGS = 3000

# Blocks a real agent's text crosses: Latin with accents, Greek, Cyrillic, Arabic, Hebrew,
# Devanagari, Thai, CJK, kana, Hangul, emoji with modifiers, combining marks.
_BLOCKS = (
    (0x20, 0x7E),
    (0xC0, 0x17F),
    (0x370, 0x3FF),
    (0x400, 0x4FF),
    (0x5D0, 0x5EA),
    (0x600, 0x6FF),
    (0x900, 0x97F),
    (0xE01, 0xE5B),
    (0x3040, 0x30FF),
    (0x4E00, 0x4FFF),
    (0xAC00, 0xAD00),
    (0x1F300, 0x1F64F),
    (0x1F3FB, 0x1F3FF),
    (0x300, 0x36F),
)
_FRAGMENTS = (
    "ToMany",
    "don't",
    "WE'LL",
    "they've",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\n\n\n",
    "   \n",
    "12345678",
    "3.14159",
    "def f(x):\n    return x ** 2",
    '{"name": "add", "arguments": {"a": 1}}',
    "สวัสดีครับ",
    "ภาษาไทย",
    "你好，世界！",
    "こんにちは",
    "안녕하세요",
    "naïve café",
    "e\u0301",
    "👍🏽",
    "👨‍👩‍👧",
    "!!!???",
    "...",
    "<think",
    "tool_call>",
    "<|im_end",
    "<|eot_id",
    "ĠHello",
)


def diverse_strings(count: int = STRINGS, seed: int = 7) -> list[str]:
    """Deterministic strings: fragments and random code points, joined by varied spacing."""
    rng = random.Random(seed)
    strings: list[str] = []
    for _ in range(count):
        parts: list[str] = []
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.5:
                parts.append(rng.choice(_FRAGMENTS))
            else:
                low, high = rng.choice(_BLOCKS)
                parts.append("".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 12))))
        strings.append("".join(part + rng.choice(("", " ", "", "  ", "\n", "\t ")) for part in parts))
    return strings

"""A few hundred varied strings for tokenizer parity tests: prose, numbers,
many scripts and emoji, code, whitespace runs and text that looks like
special tokens, then seeded random mixtures of them."""

import random

_PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "Retrieval-augmented generation reuses cached documents.",
    "It's a truth universally acknowledged, isn't it? They'll see; we'd know.",
    "Mr. O'Neil said: \"don't\" -- and left (quietly).",
    "ALL CAPS SENTENCE WITH SHOUTING!!!",
    "semi;colons, commas... and ellipses\u2026 plus \u201csmart quotes\u201d.",
    "hello", "Hello", " hello", "  hello  ", "HeLLo WoRLD", "a", "I", "",
]
_NUMBERS = [
    "3.14159", "1,000,000", "2024-01-01T12:30:00Z", "x=12345", "  42", "a  2",
    "v1.2.3", "0xDEADBEEF", "1e-10", "+1 (555) 010-9999", "\u00bd \u2153 \u2155",
    "\u0661\u0662\u0663 \u0966\u0967", "\u2460\u2461\u2462", "Ⅻ century",
    "100%", "$5.99", "x\t7", "\n\n3", "item 10 of 200", "  9  8  7  ",
]
_UNICODE = [
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe",
    "cafe\u0301 (combining accent)",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01",  # Chinese
    "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c",  # Japanese
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",  # Korean
    # skin tone, a ZWJ family and a flag
    "\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467"
    "\u200d\U0001f466 \U0001f1eb\U0001f1f7",
    "\U0001f917 Hugging Face \U0001f680\U0001f680",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644"
    "\u0645",  # Arabic
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",  # Hebrew
    "mixed \u05e2\u05d1\u05e8\u05d9\u05ea and English",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f"
    "\u092f\u093e",  # Devanagari
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",  # Thai
    "zero\u200bwidth\u200cjoin\u200d", "\ufeffBOM at start", "\u00a0non-breaking\u00a0space",
    "\U00010348 gothic \U0001d11e music", "tab\u3000ideographic space",
]
_CODE = [
    "def f(x):\n    return x * 2\n",
    "class A:\n\tdef __init__(self):\n\t\tself.x = [1, 2, 3]\n",
    "int main() {\n  printf(\"%d\\n\", 42);\n  return 0;\n}\n",
    "{\"key\": [1, 2.5, null, true], \"nested\": {\"a\": \"b\"}}",
    "<div class=\"x\">\n  <p>Hi &amp; bye</p>\n</div>",
    "SELECT * FROM t WHERE id >= 10 AND name LIKE '%x%';",
    "    if (a && b || !c) { x += 1; }  // comment",
    "#!/usr/bin/env bash\nset -euo pipefail\necho \"$HOME\"\n",
    "x = lambda y: y**2  # square\nprint(f\"{x(3)=}\")",
    "```python\nimport numpy as np\n```",
]
_WHITESPACE = [
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n\n", "\r\n", "\r\n\r\n",
    " \t \n \t", "a\n\n\nb", "trailing   ", "   leading", "a \t b", "\n \n  \n",
    "word\u00a0\u00a0word", "x" + " " * 17 + "y", "\t\n" * 5, "  \n\t  x",
]
_SPECIAL_LOOKING = [
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "text<|im_end|>text",
    "<|im_end", "im_end|>", "< |im_start| >", "<|IM_START|>", "<s></s>",
    "[INST] hi [/INST]", "<repo_name>x<file_sep>", "<|im_start|><|im_start|>",
    "<<|im_end|>>", "<|unknown_token|>",
]


def _varied_strings():
  """A few hundred strings: the fixed lists above, then seeded random
  mixtures of their pieces, of random code points and of whitespace."""
  fixed = _PROSE + _NUMBERS + _UNICODE + _CODE + _WHITESPACE + _SPECIAL_LOOKING
  rng = random.Random(1234)
  pieces = [w for s in fixed for w in s.split(" ") if w] + fixed
  separators = [" ", "  ", "\n", "\t", "", " \n", "\n\n", "   ", "\r\n"]
  mixed = []
  for _ in range(200):
    parts = rng.choices(pieces, k=rng.randint(1, 6))
    mixed.append("".join(p + rng.choice(separators) for p in parts))
  blocks = [(0x20, 0x7e), (0xa0, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff),
            (0x590, 0x6ff), (0x900, 0x97f), (0x3040, 0x30ff), (0x4e00, 0x4fff),
            (0xac00, 0xacff), (0x1f300, 0x1f64f), (0x2000, 0x206f)]
  for _ in range(100):
    chars = []
    for _ in range(rng.randint(1, 24)):
      low, high = rng.choice(blocks)
      chars.append(chr(rng.randint(low, high)))
      if rng.random() < 0.2:
        chars.append(rng.choice([" ", "  ", "\n", "\t", "0", "12"]))
    mixed.append("".join(chars))
  return fixed + mixed


STRINGS = _varied_strings()

"""A tokenizer and a text generator built in code, for runs without a GPU or network.

`tiny_tokenizer()` is byte-level: token id == byte value (0..255) plus `<|endoftext|>` (id 256)
as EOS and pad, so any UTF-8 text round-trips and nothing has to be downloaded.
`tiny_text()` writes English-like prose from a small grammar over an embedded word list.
The grammar gives the text structure a tiny model learns within a few steps (spelling,
recurring names, punctuation, agreement between a subject and its verb), so a smoke run
shows the loss falling instead of sitting at log(257).
Both are deterministic: the same call gives the same tokenizer and the same text on any
machine, so they make stable cache keys and reproducible tests.
"""

import hashlib
import random
from functools import lru_cache

TINY_TOKENIZER_NAME = "ulysses_lc/tiny-byte-v2"  # v2: a chat template
EOS_TOKEN = "<|endoftext|>"
# Bump when tiny_text's output changes, so caches keyed on it are rebuilt.
TINY_TEXT_VERSION = 1


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-in for each byte, so the tokenizers ByteLevel decoder
    # maps tokens back to bytes; here we order it so that token id == byte value.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    # BPE with no merges is a pure byte model; BPE (not WordLevel) so that the ByteLevel
    # pre-tokenizer/decoder pair, which the big models use too, round-trips every byte.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    return tok.to_str()


def tiny_tokenizer():
    """The built-in byte-level tokenizer: 256 byte tokens + `<|endoftext|>` (id 256, EOS and pad).

    Returns a `transformers.PreTrainedTokenizerFast` with `name_or_path` set to
    `TINY_TOKENIZER_NAME` and a `fingerprint` attribute (stable across machines) for cache keys.
    Its chat template writes each turn as "<|role|>\\n{content}<|end|>\\n" in plain bytes (no new
    token ids) and marks each assistant turn's content and "<|end|>" with `{% generation %}`, so
    `apply_chat_template(..., return_assistant_tokens_mask=True)` works offline.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok_json = _tiny_tokenizer_json()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok_json),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        name_or_path=TINY_TOKENIZER_NAME,
        model_max_length=1 << 62,  # a stream tokenizer: no length warning on million-token texts
    )
    tokenizer.chat_template = (
        "{%- for message in messages -%}"
        "{{- '<|' + message['role'] + '|>\\n' -}}"
        "{%- if message['role'] == 'assistant' -%}"
        "{% generation %}{{- message['content'] + '<|end|>' -}}{% endgeneration %}"
        "{%- else -%}{{- message['content'] + '<|end|>' -}}{%- endif -%}"
        "{{- '\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
    )
    definition = tok_json + tokenizer.chat_template
    tokenizer.fingerprint = f"{TINY_TOKENIZER_NAME}-{hashlib.sha256(definition.encode()).hexdigest()[:16]}"
    return tokenizer


# Embedded vocabulary: small enough that words repeat often (learnable), large enough that
# the text is not a loop. Nouns are (singular, plural); verbs are (3rd singular, plural, past).
_NAMES = ["Alice", "Bertram", "Clara", "Dorian", "Edith", "Felix", "Greta", "Hugo", "Ivy", "Jasper"]
_PLACES = ["London", "the harbour", "the old mill", "Winterbourne", "the valley", "the abbey", "the market"]
_NOUNS = [
    ("house", "houses"), ("river", "rivers"), ("letter", "letters"), ("garden", "gardens"),
    ("window", "windows"), ("horse", "horses"), ("child", "children"), ("lamp", "lamps"),
    ("road", "roads"), ("ship", "ships"), ("door", "doors"), ("book", "books"),
    ("stranger", "strangers"), ("bell", "bells"), ("field", "fields"), ("candle", "candles"),
    ("servant", "servants"), ("tree", "trees"), ("storm", "storms"), ("key", "keys"),
]
_ADJECTIVES = [
    "old", "quiet", "dark", "small", "bright", "cold", "narrow", "strange", "grey", "gentle",
    "heavy", "distant", "pale", "broken", "warm", "silent",
]
_VERBS = [
    ("watches", "watch", "watched"), ("follows", "follow", "followed"), ("finds", "find", "found"),
    ("remembers", "remember", "remembered"), ("opens", "open", "opened"), ("carries", "carry", "carried"),
    ("reaches", "reach", "reached"), ("leaves", "leave", "left"), ("hears", "hear", "heard"),
    ("keeps", "keep", "kept"), ("sees", "see", "saw"), ("passes", "pass", "passed"),
]
_INTRANSITIVE = [("waits", "wait", "waited"), ("sleeps", "sleep", "slept"), ("returns", "return", "returned"),
                 ("trembles", "tremble", "trembled"), ("speaks", "speak", "spoke")]
_PREPOSITIONS = ["near", "behind", "beyond", "under", "across", "beside", "towards"]
_ADVERBS = ["slowly", "at last", "once more", "in silence", "without a word", "before dawn", "again"]
_CONNECTIVES = ["and", "but", "while", "so", "because"]
_SAYINGS = [
    "I shall not go back", "the road is longer than it looks", "we must wait for the morning",
    "nobody keeps a secret in this house", "the letter came too late", "it was never mine to keep",
]
_ROMAN = ["I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X", "XI", "XII"]


class _Prose:
    """A grammar over the word list; `rng` decides every choice, so a seed fixes the text."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        # Each book has its own hero and place, so a long document has long-range repetition.
        self.hero = rng.choice(_NAMES)
        self.home = rng.choice(_PLACES)

    def noun_phrase(self) -> tuple[str, bool]:
        r = self.rng
        roll = r.random()
        if roll < 0.25:
            return (self.hero if r.random() < 0.6 else r.choice(_NAMES)), False
        singular, plural = r.choice(_NOUNS)
        is_plural = r.random() < 0.3
        noun = plural if is_plural else singular
        if r.random() < 0.5:
            noun = f"{r.choice(_ADJECTIVES)} {noun}"
        det = r.choice(["the", "these", "those", "many"] if is_plural else ["the", "a", "that", "every"])
        if det == "a" and noun[0] in "aeiou":
            det = "an"
        return f"{det} {noun}", is_plural

    def clause(self, past: bool) -> str:
        r = self.rng
        subject, plural = self.noun_phrase()
        if r.random() < 0.3:
            verb = r.choice(_INTRANSITIVE)
            words = [subject, verb[2] if past else verb[1 if plural else 0]]
        else:
            verb = r.choice(_VERBS)
            obj, _ = self.noun_phrase()
            words = [subject, verb[2] if past else verb[1 if plural else 0], obj]
        if r.random() < 0.4:
            place = self.home if r.random() < 0.5 else self.noun_phrase()[0]
            words += [r.choice(_PREPOSITIONS), place]
        if r.random() < 0.3:
            words.append(r.choice(_ADVERBS))
        return " ".join(words)

    def sentence(self, past: bool) -> str:
        r = self.rng
        if r.random() < 0.12:
            speaker = self.hero if r.random() < 0.5 else r.choice(_NAMES)
            return f'"{r.choice(_SAYINGS).capitalize()}," said {speaker}.'
        text = self.clause(past)
        if r.random() < 0.35:
            text += f", {r.choice(_CONNECTIVES)} {self.clause(past)}"
        return text[0].upper() + text[1:] + ("?" if r.random() < 0.05 else ".")

    def paragraph(self) -> str:
        past = self.rng.random() < 0.7  # a paragraph keeps one tense throughout
        return " ".join(self.sentence(past) for _ in range(self.rng.randint(3, 8)))


def tiny_text(num_chars: int, seed: int = 0) -> str:
    """Exactly `num_chars` characters of generated English-like prose, the same for the same seed.

    The text reads as one book: a title, then chapters ("CHAPTER IV.") of paragraphs separated
    by blank lines. Different seeds give different books (another hero, place and wording).
    """
    if num_chars < 0:
        raise ValueError(f"num_chars={num_chars} must be >= 0")
    rng = random.Random(f"ulysses_lc-tiny-{TINY_TEXT_VERSION}-{seed}")
    prose = _Prose(rng)
    parts = [f"THE {rng.choice(_ADJECTIVES).upper()} {rng.choice(_NOUNS)[0].upper()} OF {prose.home.upper()}\n\n"]
    size, chapter = len(parts[0]), 0
    while size < num_chars:
        if chapter == 0 or rng.random() < 0.04:
            heading = f"CHAPTER {_ROMAN[chapter % len(_ROMAN)]}.\n\n"
            chapter += 1
            parts.append(heading)
            size += len(heading)
        paragraph = prose.paragraph() + "\n\n"
        parts.append(paragraph)
        size += len(paragraph)
    return "".join(parts)[:num_chars]


# --model names of the embedded models: the default Qwen3, and one gated DeltaNet hybrid per family.
TINY_MODELS = ("tiny", "tiny-qwen3_5", "tiny-qwen3_5_moe", "tiny-qwen3_next")
_HYBRID_CONFIGS = {"tiny-qwen3_5": "Qwen3_5TextConfig", "tiny-qwen3_5_moe": "Qwen3_5MoeTextConfig",
                   "tiny-qwen3_next": "Qwen3NextConfig"}


def tiny_model_config(name: str = "tiny"):
    """The embedded model `name` (TINY_MODELS) over `tiny_tokenizer`'s vocabulary: "tiny" is a small Qwen3 (full
    attention, GQA); the others are gated DeltaNet hybrids (a linear-attention layer, then a gated full-attention
    one with partial rotary; the MoE ones with a shared expert).

    Their "trained length" is 1024 tokens, so the default 4096-token run goes through YaRN (factor 4)
    exactly as a real model stretched to 1M does.
    """
    if name not in TINY_MODELS:
        raise ValueError(f"no embedded model {name!r}; pick one of {TINY_MODELS}.")
    vocab = len(tiny_tokenizer())
    if name != "tiny":
        return _tiny_hybrid_config(name, vocab)
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=vocab - 1,
        pad_token_id=vocab - 1,
    )


def _tiny_hybrid_config(name: str, vocab: int):
    import transformers

    config_class = getattr(transformers, _HYBRID_CONFIGS[name], None)
    if config_class is None:
        raise ValueError(f"--model {name} needs transformers' {_HYBRID_CONFIGS[name]}, which transformers "
                         f"{transformers.__version__} lacks; install transformers 5.17 or later.")
    common = dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        max_position_embeddings=1024, eos_token_id=vocab - 1, pad_token_id=vocab - 1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    if name == "tiny-qwen3_5":
        return config_class(intermediate_size=192, **common)
    if name == "tiny-qwen3_5_moe":
        return config_class(**moe, **common)
    return config_class(intermediate_size=192, decoder_sparse_step=1, mlp_only_layers=[], **moe, **common)

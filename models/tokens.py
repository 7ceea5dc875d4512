"""The family's tokenizer (a byte-level BPE trained with the ``tokenizers`` library) and the
tokenised corpus splits the models train on."""

from __future__ import annotations

import json
import logging
import pathlib

import torch
from tqdm import tqdm

from models.corpus import SPLITS, WORK_DIR, read_file_list

LOG = logging.getLogger("models.tokens")

TOKENIZER_DIR = WORK_DIR / "tokenizer"
DATA_DIR = WORK_DIR / "data"

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"


def train_tokenizer() -> None:
    """Byte-level BPE (vocab 4096) on the training splits, saved in transformers format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (TOKENIZER_DIR / "tokenizer.json").exists():
        LOG.info("tokenizer exists at %s", TOKENIZER_DIR)
        return
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = [str(path) for split in ("lib", "test") for path in read_file_list(split)]
    tokenizer.train(files, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=CHAT_TEMPLATE,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(TOKENIZER_DIR)
    use_portable_tokenizer_class(TOKENIZER_DIR)
    LOG.info("tokenizer trained on %d files, vocab %d", len(files), tokenizer.get_vocab_size())


#: The family's chat template: ``"<role>: <content>\n"`` per message (``developer`` as
#: ``system``), then ``"assistant:"`` when a reply is to be generated.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- ('system' if message['role'] == 'developer' else message['role']) + ': ' + message['content'] + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:' -}}{%- endif -%}"
)


def use_portable_tokenizer_class(directory: pathlib.Path) -> None:
    """Name the class ``PreTrainedTokenizerFast``: transformers 4.x and 5.x both load that."""
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


# --------------------------------------------------------------------------- token data


def tokenize_splits() -> None:
    """Tokenise each split to one int16-packed tensor: documents joined by ``<|endoftext|>``."""
    tokenizer = load_tokenizer()
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        out = DATA_DIR / f"{split}.pt"
        if out.exists():
            continue
        ids: list[int] = []
        files = read_file_list(split)
        for path in tqdm(files, desc=f"tokenise {split}", mininterval=5):
            ids.extend(tokenizer(path.read_text(encoding="utf-8"))["input_ids"])
            ids.append(tokenizer.eos_token_id)
        torch.save(torch.tensor(ids, dtype=torch.int16), out)  # vocab 4096 fits in int16
        LOG.info("split %s: %d files, %d tokens", split, len(files), len(ids))


def load_tokens(splits: tuple[str, ...]) -> torch.Tensor:
    """Concatenated token ids of ``splits`` as int64.  # [N]"""
    return torch.cat([torch.load(DATA_DIR / f"{split}.pt").long() for split in splits])


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int):
    """Random windows of ``seq_len + 1`` tokens, determined by ``(seed, step)`` alone."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])  # [B, L+1]
    return windows[:, :-1], windows[:, 1:]

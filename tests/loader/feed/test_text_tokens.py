"""One token count: the decoder tokenizes text as the index counted it, so token budgets hold; a decoder
tokenizer set otherwise is refused at start, in one line."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from omnifeed.loader import DecodeConfig, Feed, FeedConfig, IndexConfig, PlanConfig, SampleIndex, build_index
from omnifeed.loader.decode import TextDecodeConfig

CAPTIONS = ["a cat, sitting on a mat!", "naïve café—déjà vu?", "", "x" * 40, "3.14 is π… (roughly)"]


def text_index(folder: Path, tokenizer: str | None = None) -> SampleIndex:
    with tarfile.open(folder / "a.tar", "w") as tar:
        for i, caption in enumerate(CAPTIONS * 3):
            data = f"{caption} {i}".encode()
            info = tarfile.TarInfo(f"s-{i:02d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    config = IndexConfig(workers=1) if tokenizer is None else IndexConfig(workers=1, tokenizer=tokenizer)
    return SampleIndex(build_index([str(folder / "a.tar")], folder / "index", config, progress=False).path)


def decode(tokenizer: str | None = None) -> FeedConfig:
    return FeedConfig(
        plan=PlanConfig(seed=3, batch_size=4), decode=DecodeConfig(text=TextDecodeConfig(tokenizer=tokenizer))
    )


@pytest.mark.parametrize("indexed", [None, "whitespace", "bytes"])
def test_by_default_every_text_decodes_to_as_many_tokens_as_the_index_counted(
    tmp_path: Path, indexed: str | None
) -> None:
    index = text_index(tmp_path, indexed)
    counted = {index.sample(p).key: index.sample(p).lengths.text_tokens for p in range(index.num_samples)}
    seen = {}
    with Feed(index, decode()) as feed:
        for batch in feed:
            seen.update(zip(batch["__key__"], batch["text"]["lengths"].tolist()))
    assert seen == counted and max(counted.values()) > 1


def test_a_decoder_tokenizer_other_than_the_index_s_is_refused_at_start_in_one_line(tmp_path: Path) -> None:
    index = text_index(tmp_path)
    with pytest.raises(ValueError) as refused:
        Feed(index, decode("bytes"))
    message = str(refused.value)
    assert "\n" not in message and "'bytes'" in message and "'regex'" in message and "unset" in message
    with Feed(index, decode("regex")) as feed:  # the index's own, set explicitly, is fine
        assert feed.next_batch()["text"]["tokens"].shape[0] == 4

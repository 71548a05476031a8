"""Tokenizers: UTF-8 bytes (no training, used by the embedded default) and sentencepiece."""
import numpy as np


class ByteTokenizer:
  """Ids 0..255 are the UTF-8 bytes; then BOS, EOS and PAD."""
  bos_id = 256
  eos_id = 257
  pad_id = 258
  vocab_size = 259

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
    return data.decode('utf-8', errors='replace')

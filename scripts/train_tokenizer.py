r"""Trains a sentencepiece tokenizer (BPE or unigram, byte fallback) on text sources.

  python scripts/train_tokenizer.py --input 'data/fineweb/*.jsonl,data/pdfs.parquet#content' \
      --vocab-size 32000 --model-type bpe --output tokenizers/en32k.model

Ids: unk 0, BOS 1, EOS 2, pad 3. Then give the .model to scripts/prepare_data.py --tokenizer.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_pretrain.data import sources  # pylint: disable=wrong-import-position
from jax_pretrain.data import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position
from jax_pretrain.data.errors import DataError  # pylint: disable=wrong-import-position


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--input', required=True, help='text source list (weights are ignored)')
  p.add_argument('--output', required=True, help='the .model file to write')
  p.add_argument('--vocab-size', type=int, default=32000)
  p.add_argument('--model-type', default='bpe', choices=('bpe', 'unigram'))
  p.add_argument('--max-sentences', type=int, default=2_000_000,
                 help='lines sampled for training (sentencepiece input_sentence_size)')
  p.add_argument('--text-field', default='text')
  p.add_argument('--on-bad-record', default='error', choices=('error', 'skip'))
  p.add_argument('--tfds-data-dir', default='')
  a = p.parse_args()
  t0 = time.perf_counter()
  try:
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    tok = tokenizer_lib.train_sentencepiece(
        sources.texts(a.input, a.text_field, a.tfds_data_dir, a.on_bad_record), a.output,
        a.vocab_size, a.model_type, a.max_sentences)
  except DataError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(f'wrote {a.output}: {a.model_type}, vocab_size {tok.vocab_size} (bos {tok.bos_id}, '
        f'eos {tok.eos_id}, pad {tok.pad_id}) in {time.perf_counter() - t0:.1f} s')
  return 0


if __name__ == '__main__':
  sys.exit(main())

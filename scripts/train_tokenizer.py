r"""Trains a sentencepiece tokenizer (BPE or unigram, byte fallback) on text sources.

  python scripts/train_tokenizer.py --input 'data/fineweb/*.jsonl,data/pdfs.parquet#content' \
      --vocab-size 32000 --model-type bpe --output tokenizers/en32k.model

Ids: unk 0, BOS 1, EOS 2, pad 3. Then give the .model to scripts/prepare_data.py --tokenizer.
"""
import argparse
import os
import time

from jax_pretrain import cli
from jax_pretrain.data import sources
from jax_pretrain.data import tokenizer as tokenizer_lib


def main() -> None:
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
  with cli.user_errors():
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    options = sources.ReadOptions(a.text_field, a.tfds_data_dir, a.on_bad_record)
    tok = tokenizer_lib.train_sentencepiece(sources.texts(a.input, options), a.output,
                                            a.vocab_size, a.model_type, a.max_sentences)
  print(f'wrote {a.output}: {a.model_type}, vocab_size {tok.vocab_size} (bos {tok.bos_id}, '
        f'eos {tok.eos_id}, pad {tok.pad_id}) in {time.perf_counter() - t0:.1f} s')


if __name__ == '__main__':
  main()

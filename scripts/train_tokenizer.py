r"""Trains a tokenizer on text sources: sentencepiece (BPE or unigram, byte fallback), or with
Hugging Face tokenizers a byte-level BPE tokenizer.json (the kind GPT-2, SmolLM and Llama 3 ship).

  python scripts/train_tokenizer.py --input 'data/fineweb/*.jsonl,data/pdfs.parquet#content' \
      --vocab-size 32000 --type bpe --output tokenizers/en32k.model
  python scripts/train_tokenizer.py --input 'data/fineweb/*.jsonl' \
      --vocab-size 32000 --type bpe-bytelevel --output tokenizers/en32k-bl/tokenizer.json

sentencepiece ids: unk 0, BOS 1, EOS 2, pad 3. bpe-bytelevel ids: <|endoftext|> 0 (EOS and BOS),
<|pad|> 1; it also writes tokenizer_config.json beside tokenizer.json, so the directory loads with
AutoTokenizer.from_pretrained too. Give the .model, or the tokenizer.json (or its directory), to
scripts/prepare_data.py --tokenizer or --config.data.tokenizer.
"""
import argparse
import itertools
import os
import time

from jax_pretrain import cli
from jax_pretrain.data import sources
from jax_pretrain.data import tokenizer as tokenizer_lib


def main() -> None:
  cli.output_policy()
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--input', required=True, help='text source list (weights are ignored)')
  p.add_argument('--output', required=True,
                 help='the .model file to write (bpe-bytelevel: DIR/tokenizer.json, or DIR)')
  p.add_argument('--vocab-size', type=int, default=32000)
  p.add_argument('--type', '--model-type', dest='type', default='bpe',
                 choices=('bpe', 'unigram', 'bpe-bytelevel'),
                 help='sentencepiece bpe or unigram, or a byte-level BPE tokenizer.json')
  p.add_argument('--max-sentences', type=int, default=2_000_000,
                 help='sentencepiece: lines sampled for training (input_sentence_size); '
                 'bpe-bytelevel: the first this many documents')
  p.add_argument('--text-field', default='text')
  p.add_argument('--on-bad-record', default='error', choices=('error', 'skip'))
  p.add_argument('--tfds-data-dir', default='')
  a = p.parse_args()
  t0 = time.perf_counter()
  with cli.user_errors():
    output = a.output
    if a.type == 'bpe-bytelevel' and not output.endswith('.json'):
      output = os.path.join(output, tokenizer_lib.HfTokenizer.file_name)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    texts = sources.texts(a.input, sources.ReadOptions(a.text_field, a.tfds_data_dir,
                                                       a.on_bad_record))
    if a.type == 'bpe-bytelevel':
      tok = tokenizer_lib.train_bytelevel_bpe(itertools.islice(texts, a.max_sentences), output,
                                              a.vocab_size)
    else:
      tok = tokenizer_lib.train_sentencepiece(texts, output, a.vocab_size, a.type,
                                              a.max_sentences)
  print(f'wrote {output}: {a.type}, vocab_size {tok.vocab_size} (bos {tok.bos_id}, '
        f'eos {tok.eos_id}, pad {tok.pad_id}) in {time.perf_counter() - t0:.1f} s')


if __name__ == '__main__':
  main()

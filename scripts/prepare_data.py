r"""Tokenizes text sources once into a directory that training memory-maps (docs/data.md).

  python scripts/prepare_data.py \
      --train 'data/fineweb/*.jsonl:0.7,data/pdfs.parquet#content:0.3' --val-ratio 0.01 \
      --tokenizer tokenizers/en32k.model --output-dir data/prepared
  python -m jax_pretrain.main --config=configs/small.py --config.data.train=data/prepared

Prints documents, tokens and skipped records per source, and the throughput. Re-running on
unchanged input does nothing; the output appears only once complete.
"""
import argparse

from jax_pretrain import cli
from jax_pretrain.data import prepare


def main() -> None:
  cli.output_policy()
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--train', required=True, help="source list 'SOURCE[#field][:weight],...'")
  p.add_argument('--val', default='', help='eval source list (or use --val-ratio)')
  p.add_argument('--val-ratio', type=float, default=0.0,
                 help='hold out this share of each train source (from a document start)')
  p.add_argument('--tokenizer', default='byte',
                 help="'byte', a sentencepiece .model, a tokenizer.json, or a directory holding "
                 "one (a Hugging Face model's, a run's tokenizer/)")
  p.add_argument('--output-dir', required=True)
  p.add_argument('--text-field', default='text', help='JSONL key / Parquet column / TFDS feature')
  p.add_argument('--on-bad-record', default='error', choices=('error', 'skip'))
  p.add_argument('--tfds-data-dir', default='')
  p.add_argument('--workers', type=int, default=0, help='tokenizing processes (0: one per core)')
  a = p.parse_args()
  with cli.user_errors():
    prepare.prepare(a.train, a.output_dir, tokenizer=a.tokenizer, val=a.val,
                    val_ratio=a.val_ratio, text_field=a.text_field,
                    on_bad_record=a.on_bad_record, tfds_data_dir=a.tfds_data_dir,
                    workers=a.workers)


if __name__ == '__main__':
  main()

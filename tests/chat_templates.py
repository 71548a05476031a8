"""Chat templates and tokenizers for the chat tests (test_chat_template.py, test_serve.py):
small faithful copies of Qwen3's, Llama 3's and Mistral's templates, and tokenizers that know their
special tokens, built here (no download)."""
import os

import tokenizers

from jax_pretrain.data import tokenizer as tokenizer_lib

# Faithful copies of the templates' logic (tools left out). Qwen3's: the system turn first, and the
# <think> of an assistant turn kept only after the last user turn (earlier turns lose it).
QWEN3 = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n')
                .split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n')
                    + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
# QWEN3's assistant turn, which its training and marked variants rewrite.
_ASSISTANT_TURN = r"""        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n')
                    + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}"""
assert _ASSISTANT_TURN in QWEN3
# TRL's training variant of it (trl/chat_templates/qwen3_training.jinja): every <think> kept, the
# assistant's output inside {% generation %}.
QWEN3_TRAINING = QWEN3.replace(_ASSISTANT_TURN,
                             r"""        {{- '<|im_start|>' + message.role + '\n' }}
        {%- generation %}
        {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n'
            + content.lstrip('\n') }}
        {{- '<|im_end|>\n' }}
        {%- endgeneration %}""")
assert QWEN3_TRAINING != QWEN3
# The same text as QWEN3's, each assistant turn after its header inside {% generation %} (for
# transformers' assistant mask).
QWEN3_MARKED = QWEN3.replace(_ASSISTANT_TURN,
                             r"""        {{- '<|im_start|>' + message.role + '\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n'
                + content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
        {%- endgeneration %}""")
assert QWEN3_MARKED != QWEN3
# DeepSeek-R1-distill's kind: its generation prompt opens a <think> that the turns, their
# reasoning dropped, do not have.
R1_LIKE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|im_start|>' + m['content'] }}"
           "{% else %}{{ '<|im_end|>' + m['content'].split('</think>')[-1] + '</s>' }}{% endif %}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_end|><think>\n' }}{% endif %}")
# Meta-Llama-3-8B-Instruct's, verbatim: header tokens, BOS written by the template.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
          "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
          "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Mistral-7B-Instruct-v0.2's, verbatim: <s>, [INST] as text, the assistant's turn ended by </s>.
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
           "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
           "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
           "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only "
           "user and assistant roles are supported!') }}{% endif %}{% endfor %}")
TEMPLATES = {  # name: (template, bos_token, eos_token)
    'qwen3': (QWEN3, None, '<|im_end|>'),
    'llama3': (LLAMA3, '<|begin_of_text|>', '<|eot_id|>'),
    'mistral': (MISTRAL, '<s>', '</s>'),
}
SPECIAL = ['<s>', '</s>', '<|im_start|>', '<|im_end|>', '<|begin_of_text|>',
           '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>']
ADDED = ['<think>', '</think>']  # added, not special (as Qwen3's)
TEXTS = ['The cat sat on the mat. What is 2 + 3? It is 5, and 4 + 3 is 7. Be brief, think it '
         'over: hmm.\n user assistant system [INST] [/INST] héllo wörld'] * 30
THINKING = '<think>\nhmm, 2 + 3\n</think>\n\nIt is 5.'
CONVERSATIONS = {
    'single': [{'role': 'user', 'content': 'What is 2 + 3?'}],
    'multi': [{'role': 'user', 'content': 'What is 2 + 3?'},
              {'role': 'assistant', 'content': THINKING},
              {'role': 'user', 'content': ' and 4 + 3? héllo'}],
}
SYSTEM = {'role': 'system', 'content': 'Be brief.'}


def bytelevel(directory) -> None:
  tokenizer_lib.train_bytelevel_bpe(TEXTS, str(directory / 'tokenizer.json'), 400)
  tok = tokenizers.Tokenizer.from_file(str(directory / 'tokenizer.json'))
  tok.add_special_tokens(SPECIAL)
  tok.add_tokens(ADDED)
  tok.save(str(directory / 'tokenizer.json'))


def metaspace(directory) -> None:
  """A Metaspace BPE tokenizer.json (Mistral's and Llama 2's kind in their tokenizer.json): '▁'
  for a space and before the text, 'first' (only at its very start)."""
  os.makedirs(directory)
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme='first')
  tok.decoder = tokenizers.decoders.Metaspace(prepend_scheme='first')
  tok.train_from_iterator(TEXTS, tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=['<unk>', *SPECIAL], show_progress=False))
  tok.add_tokens(ADDED)
  tok.save(str(directory / 'tokenizer.json'))


def sentencepiece(directory) -> None:
  """A sentencepiece model whose template tokens are control pieces (never matched in text by
  sentencepiece itself: <s> in a template is the reason to split on them) and <think> a
  user-defined one, with the tokenizer_config.json that makes transformers read it as Llama 2's
  (legacy: a '▁' before the text after each special token)."""
  import sentencepiece as spm  # noqa: PLC0415
  os.makedirs(directory)
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(TEXTS), model_prefix=str(directory / 'tokenizer'), vocab_size=400,
      model_type='bpe', byte_fallback=True, normalization_rule_name='identity',
      remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
      control_symbols=SPECIAL[2:], user_defined_symbols=ADDED, num_threads=1, minloglevel=2)

"""Chat-template families for the tiny model: each family's turn format and special tokens.

The prefix splice (DESIGN §5) has to hold for the templates real models ship, not only for
ChatML, so the tiny model can be built with the turn structure of each common family.
Every template here is written from that family's documented prompt format (turn markers,
which token closes a turn, where tools and tool results go, what happens to reasoning in
the history); none is a copy of a model's own template. The special tokens are added to
the tiny tokenizer after training, so the trained vocabulary is the same for every family.

What each family does to the splice:
- ``qwen3``: ChatML; reasoning of turns before the last user message is dropped; tool
  results go inside user turns; ``enable_thinking=false`` pre-fills an empty think block.
- ``llama3``: header turns closed by ``<|eot_id|>``, which is not the tokenizer's EOS
  (``<|end_of_text|>``); both stop the engine.
- ``gemma``: ``<end_of_turn>`` closes every turn and stops the engine; there is no system
  role (the system text opens the first user turn).
- ``deepseek_r1``: BOS once, user turns not closed at all, assistant turns closed by
  the end-of-sentence token, reasoning stripped from every earlier assistant turn.
- ``mistral``: ``[INST]`` turns, ``</s>`` closes assistant turns only, the system text
  and the tool list travel with the last user message (so earlier turns re-render).
"""

from __future__ import annotations

from dataclasses import dataclass

# Emits a message's text whether its content is a string or a list of text parts.
_TEXT_OF = r"""
{%- macro text_of(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}{%- if part.text is defined -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro args_of(fn) -%}
    {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{%- endmacro -%}
{%- macro spec_of(tool) -%}
    {{- (tool.function if tool.function is defined else tool) | tojson -}}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = text_of(messages[0].content) -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system_text = none -%}
    {%- set turns = messages -%}
{%- endif -%}
"""

_QWEN3 = r"""
{%- if system_text is not none or tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if system_text is not none -%}{{- system_text -}}{%- endif -%}
    {%- if tools -%}
        {%- if system_text is not none -%}{{- '\n\n' -}}{%- endif -%}
        {{- '# Tools\n\nFunction signatures are inside <tools></tools>:\n<tools>' -}}
        {%- for tool in tools -%}{{- '\n' + spec_of(tool) -}}{%- endfor -%}
        {{- '\n</tools>\n\nTo call one, reply with <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in turns -%}
    {%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in turns -%}
    {%- if message.role == 'assistant' -%}
        {%- set body = text_of(message.content) -%}
        {%- if message.reasoning_content is defined and message.reasoning_content -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif message.reasoning is defined and message.reasoning -%}
            {%- set reasoning = message.reasoning -%}
        {%- else -%}
            {%- set reasoning = '' -%}
        {%- endif -%}
        {%- if '</think>' in body -%}
            {%- if not reasoning -%}
                {%- set reasoning = body.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
            {%- endif -%}
            {%- set body = body.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if reasoning and loop.index0 > ns.last_query -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- body -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if body or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' + args_of(fn) + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or turns[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or turns[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

_LLAMA3 = r"""
{{- bos_token -}}
{%- if system_text is not none or tools -%}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
    {%- if system_text is not none -%}{{- system_text | trim -}}{%- endif -%}
    {%- if tools -%}
        {%- if system_text is not none -%}{{- '\n\n' -}}{%- endif -%}
        {{- 'To call a function, reply with JSON {"name": <name>, "parameters": <object>}. Functions:' -}}
        {%- for tool in tools -%}{{- '\n' + spec_of(tool) -}}{%- endfor -%}
    {%- endif -%}
    {{- '<|eot_id|>' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message.role == 'assistant' -%}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' + (text_of(message.content) | trim) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '{"name": ' + (fn.name | tojson) + ', "parameters": ' + args_of(fn) + '}' -}}
        {%- endfor -%}
        {{- '<|eot_id|>' -}}
    {%- else -%}
        {%- set role = 'ipython' if message.role == 'tool' else message.role -%}
        {{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + (text_of(message.content) | trim) + '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

_GEMMA = r"""
{{- bos_token -}}
{%- set ns = namespace(opening='') -%}
{%- if system_text is not none -%}{%- set ns.opening = system_text + '\n\n' -%}{%- endif -%}
{%- if tools -%}
    {%- set ns.opening = ns.opening + 'To call a function, reply with ```tool_code\n{"name": <name>, "arguments": <object>}\n```. Functions:' -%}
    {%- for tool in tools -%}{%- set ns.opening = ns.opening + '\n' + spec_of(tool) -%}{%- endfor -%}
    {%- set ns.opening = ns.opening + '\n\n' -%}
{%- endif -%}
{%- for message in turns -%}
    {%- set opening = ns.opening if loop.first else '' -%}
    {%- if message.role == 'assistant' -%}
        {{- '<start_of_turn>model\n' + opening + (text_of(message.content) | trim) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '```tool_code\n{"name": ' + (fn.name | tojson) + ', "arguments": ' + args_of(fn) + '}\n```' -}}
        {%- endfor -%}
        {{- '<end_of_turn>\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<start_of_turn>user\n' + opening + '```tool_output\n' + text_of(message.content) + '\n```<end_of_turn>\n' -}}
    {%- else -%}
        {{- '<start_of_turn>user\n' + opening + (text_of(message.content) | trim) + '<end_of_turn>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

_DEEPSEEK_R1 = r"""
{{- bos_token -}}
{%- if system_text is not none -%}{{- system_text -}}{%- endif -%}
{%- if tools -%}
    {{- '\n\n## Tools\nCall a function with <｜tool▁calls▁begin｜>. Functions:' -}}
    {%- for tool in tools -%}{{- '\n' + spec_of(tool) -}}{%- endfor -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if message.role == 'assistant' -%}
        {%- set body = text_of(message.content) -%}
        {%- if '</think>' in body -%}{%- set body = body.split('</think>')[-1] -%}{%- endif -%}
        {{- '<｜Assistant｜>' + body -}}
        {%- if message.tool_calls -%}
            {{- '<｜tool▁calls▁begin｜>' -}}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + fn.name + '\n```json\n' + args_of(fn) + '\n```<｜tool▁call▁end｜>' -}}
            {%- endfor -%}
            {{- '<｜tool▁calls▁end｜>' -}}
        {%- endif -%}
        {{- '<｜end▁of▁sentence｜>' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or turns[loop.index0 - 1].role != 'tool' -%}{{- '<｜tool▁outputs▁begin｜>' -}}{%- endif -%}
        {{- '<｜tool▁output▁begin｜>' + text_of(message.content) + '<｜tool▁output▁end｜>' -}}
        {%- if loop.last or turns[loop.index0 + 1].role != 'tool' -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}
    {%- else -%}
        {{- '<｜User｜>' + text_of(message.content) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜><think>\n' -}}{%- endif -%}
"""

_MISTRAL = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for message in turns -%}
    {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- for message in turns -%}
    {%- if message.role == 'user' -%}
        {%- if tools and loop.index0 == ns.last_user -%}
            {{- '[AVAILABLE_TOOLS] [' -}}
            {%- for tool in tools -%}{%- if not loop.first -%}{{- ', ' -}}{%- endif -%}{{- spec_of(tool) -}}{%- endfor -%}
            {{- '][/AVAILABLE_TOOLS]' -}}
        {%- endif -%}
        {%- if system_text is not none and loop.index0 == ns.last_user -%}
            {{- '[INST] ' + system_text + '\n\n' + text_of(message.content) + '[/INST]' -}}
        {%- else -%}
            {{- '[INST] ' + text_of(message.content) + '[/INST]' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {%- if message.tool_calls -%}
            {{- '[TOOL_CALLS] [' -}}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}{{- ', ' -}}{%- endif -%}
                {{- '{"name": ' + (fn.name | tojson) + ', "arguments": ' + args_of(fn) + '}' -}}
            {%- endfor -%}
            {{- ']' -}}
        {%- else -%}
            {{- ' ' + (text_of(message.content) | trim) -}}
        {%- endif -%}
        {{- '</s>' -}}
    {%- elif message.role == 'tool' -%}
        {{- '[TOOL_RESULTS] {"content": ' + (text_of(message.content) | tojson) + '}[/TOOL_RESULTS]' -}}
    {%- else -%}
        {{- '[INST] ' + text_of(message.content) + '[/INST]' -}}
    {%- endif -%}
{%- endfor -%}
"""


@dataclass(frozen=True)
class Family:
    """A template with the tokens it needs and how the model built for it stops.

    ``eos`` is the tokenizer's EOS (and config.json's ``eos_token_id``); ``stops`` are
    generation_config's ids, the engine stopping on any of them, turn closers first.
    """

    name: str
    summary: str
    template: str
    special_tokens: tuple[str, ...]
    eos: str
    stops: tuple[str, ...]
    bos: str | None = None


def _template(body: str) -> str:
    return (_TEXT_OF.strip() + "\n" + body.strip()).strip() + "\n"


_IM = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")  # already in the trained tokenizer

FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen3",
        "ChatML with thinking: earlier reasoning dropped, enable_thinking honoured",
        _template(_QWEN3),
        special_tokens=(),
        eos="<|im_end|>",
        stops=_IM[1:],
    ),
    Family(
        "llama3",
        "header turns closed by <|eot_id|>, which is not the tokenizer's EOS",
        _template(_LLAMA3),
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        eos="<|end_of_text|>",
        stops=("<|eot_id|>", "<|end_of_text|>"),
        bos="<|begin_of_text|>",
    ),
    Family(
        "gemma",
        "<start_of_turn>/<end_of_turn> turns, no system role",
        _template(_GEMMA),
        special_tokens=("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
        eos="<eos>",
        stops=("<end_of_turn>", "<eos>"),
        bos="<bos>",
    ),
    Family(
        "deepseek_r1",
        "BOS once, reasoning stripped from history, end-of-sentence after assistant turns",
        _template(_DEEPSEEK_R1),
        special_tokens=(
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ),
        eos="<｜end▁of▁sentence｜>",
        stops=("<｜end▁of▁sentence｜>",),
        bos="<｜begin▁of▁sentence｜>",
    ),
    Family(
        "mistral",
        "[INST] turns, </s> closing assistant turns, system and tools with the last user turn",
        _template(_MISTRAL),
        special_tokens=(
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        eos="</s>",
        stops=("</s>",),
        bos="<s>",
    ),
)

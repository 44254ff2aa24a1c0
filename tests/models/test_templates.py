"""Chat templates: rendered as transformers renders them, and contained when they are hostile.

A GGUF's chat template is untrusted code. The reference for the output is transformers'
`render_jinja_template` on the same template and messages; the hostile ones must fail with
ChatTemplateError, touch nothing, and stop within their budget.
"""

import time

import pytest

from headwise.models.chat_template import ChatTemplateError, Limits, render_chat_template

# Gemma 3's chat template (google/gemma-3-*-it, tokenizer_config.json): the system turn is folded
# into the first user turn, the assistant is called "model".
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Qwen2.5's chat template (Qwen/Qwen2.5-*-Instruct), tools and tool calls included.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The helpers and statements real templates lean on (Qwen3's reverse scan with a namespace, loop
# controls, strftime_now, tojson options, {% generation %}, dict(), filters and tests).
HELPERS = """{%- set ns = namespace(last_user=-1, n=0) -%}
{%- for m in messages[::-1] -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = messages|length - 1 - loop.index0 -%}{%- break -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}
  {%- set ns.n = ns.n + 1 -%}
  [{{ loop.index }}/{{ loop.length }} {{ m.role|upper }}{{ '*' if loop.index0 == ns.last_user }}]
  {%- if m.role == 'assistant' -%}{% generation %}{{ m.content|trim }}{% endgeneration %}
  {%- else -%}{{ m.content|replace('\\n', ' ')|truncate(40) }}{%- endif %}
{% endfor -%}
{{ dict(a=1, b=[1, 2]) | tojson(indent=2, sort_keys=True) }} {{ {'é': 'ü'} | tojson }} {{ ns.n }}
{{ strftime_now('%Y') | length }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }}
{%- if enable_thinking is defined and not enable_thinking %} /no_think{% endif -%}
{%- if add_generation_prompt %}<assistant>{% endif -%}
"""

CHATS = {
    "plain": [{"role": "user", "content": "Hi there"}],
    "system": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "  What is 2+2? 🤔  "},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "日本語で?\nplease"},
    ],
    "parts": [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " describe "}]},
    ],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CHAT = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "user", "content": "Thanks"},
]
SPECIALS = dict(bos_token="<bos>", eos_token="<eos>")


def transformers_render(template, messages, add_generation_prompt, **kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return rendered[0]


# Qwen2.5's template concatenates content as a string: list content ("parts") is not its input
CASES = [(n, c) for n in ("gemma3", "qwen2.5", "helpers") for c in sorted(CHATS) if (n, c) != ("qwen2.5", "parts")]
TEMPLATES = {"gemma3": GEMMA3, "qwen2.5": QWEN25, "helpers": HELPERS}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name,chat", CASES)
def test_render_equals_transformers(name, chat, add_generation_prompt):
    template, messages = TEMPLATES[name], CHATS[chat]
    for extra in ({}, {"enable_thinking": False}):
        ours = render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, **SPECIALS, **extra
        )
        assert ours == transformers_render(template, messages, add_generation_prompt, **SPECIALS, **extra)
    if name == "gemma3":
        assert ours.startswith("<bos><start_of_turn>user\n") and ours.count("<start_of_turn>system") == 0
        assert ours.endswith("<start_of_turn>model\n") == add_generation_prompt


def test_gemma3_folds_the_system_turn():
    text = render_chat_template(GEMMA3, CHATS["system"], **SPECIALS)
    assert text.startswith(
        "<bos><start_of_turn>user\nBe terse.\n\nWhat is 2+2? 🤔<end_of_turn>\n<start_of_turn>model\n4."
    )
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat_template(GEMMA3, [{"role": "assistant", "content": "x"}], **SPECIALS)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen_tools_equal_transformers(add_generation_prompt):
    ours = render_chat_template(QWEN25, TOOL_CHAT, add_generation_prompt=add_generation_prompt, tools=TOOLS)
    assert ours == transformers_render(QWEN25, TOOL_CHAT, add_generation_prompt, tools=TOOLS)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in ours
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in ours
    assert ours.count("<tool_response>") == 2 and ours.count("<|im_start|>user") == 3


def test_inputs_reach_the_template_as_plain_data():
    """Objects with methods (here one that would write a file) are not handed to the template."""

    class Sneaky(str):
        def write_file(self):  # pragma: no cover -- must never run
            raise AssertionError("reached")

    messages = [{"role": "user", "content": Sneaky("x")}]
    assert render_chat_template("{{ messages[0].content.write_file is defined }}", messages) == "False"


# ---- hostile templates -------------------------------------------------------------------

ESCAPES = {
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "messages-class": "{{ messages.__class__.__base__.__subclasses__() }}",
    "cycler-globals": "{{ cycler.__init__.__globals__.os.system('touch {flag}') }}",
    "joiner-globals": "{{ joiner.__init__.__globals__ }}",
    "self-globals": "{{ self.__init__.__globals__.__builtins__.open('{flag}', 'w') }}",
    "namespace-globals": "{{ namespace.__init__.__globals__ }}",
    "raise-globals": "{{ raise_exception.__globals__.__builtins__.__import__('os').system('touch {flag}') }}",
    "strftime-globals": "{{ strftime_now.__globals__ }}",
    "dict-globals": "{{ dict.__globals__ }}",
    "format-attr": "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "import": "{% import 'os' as os %}{{ os.system('touch {flag}') }}",
    "include": "{% include '/etc/passwd' %}",
    "extends": "{% extends '/etc/passwd' %}",
    "from-import": "{% from 'os' import system %}{{ system('touch {flag}') }}",
    "mutate-list": "{{ messages.append({'role': 'x'}) }}",
    "mutate-dict": "{{ messages[0].update(role='x') }}",
    "namespace-dunder": "{% set ns = namespace(__class__=1) %}{{ ns }}",
    "namespace-set-dunder": "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "attr-filter": "{{ messages | attr('__class__') | attr('__mro__') }}",
    "map-attr": "{{ messages | map(attribute='__class__') | list }}",
}
BUDGET = {
    "nested-range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested-messages": "{% for a in messages %}{% for b in range(99999) %}{% for c in range(99999) %}{% endfor %}"
    "{% endfor %}{% endfor %}",
    "huge-range": "{{ range(10**12) | list }}",
    "repeat-string": "{{ 'a' * 10**10 }}",
    "repeat-list": "{{ [1, 2] * 10**10 }}",
    "power": "{{ 2 ** 1000000000 }}",
    "percent-width": "{{ '%1000000000d' % 1 }}",
    "center": "{{ 'x' | center(10**10) }}",
    "method-width": "{{ 'x'.ljust(10**10) }}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "replace-filter": "{{ ('x' * 100000) | replace('x', 'y' * 100000) }}",
    "replace-method": "{{ ('x' * 100000).replace('x', 'y' * 100000) }}",
    "join-filter": "{{ range(100000) | join('z' * 100000) }}",
    "join-method": "{{ ('z' * 100000).join(range(100000) | map('string')) }}",
    "indent": "{{ ('x\\n' * 4000) | indent(8000000) }}",
    "format-filter": "{{ '%8000000d%8000000d' | format(1, 2) }}",
    "format-method": "{{ '{:>8000000}{:>8000000}'.format(1, 2) }}",
    "join-loop": "{% for i in range(100000) %}{% set s = range(99999) | join(',') %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escapes_fail_and_touch_nothing(name, tmp_path):
    flag = tmp_path / "pwned"
    template = ESCAPES[name].replace("{flag}", str(flag))
    with pytest.raises(ChatTemplateError, match="sandbox forbids|may not start with '_'|may not import"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert not flag.exists()


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_budgets_stop_runaway_templates(name):
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError) as e:
        render_chat_template(BUDGET[name], [{"role": "user", "content": "hi"}])
    # the default budget (Limits: 2M steps, 5 s); generous for a loaded 2-core CI machine
    assert time.perf_counter() - start < 12, name
    assert "chat template" in str(e.value)


def test_limits_are_per_call():
    loop = "{% for i in range(1000) %}{{ i }}{% endfor %}"
    assert render_chat_template(loop, []).startswith("0123")
    with pytest.raises(ChatTemplateError, match="more than 100 steps"):
        render_chat_template(loop, [], limits=Limits(steps=100))
    with pytest.raises(ChatTemplateError, match="output passed 50 characters"):
        render_chat_template("{% for i in range(10) %}abcdefghij{% endfor %}", [], limits=Limits(output_chars=50))
    assert len(render_chat_template(loop, [])) == sum(len(str(i)) for i in range(1000))  # budget reset

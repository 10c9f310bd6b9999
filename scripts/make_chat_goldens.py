#!/usr/bin/env python3
"""Renders every chat template fixture with transformers' own apply_chat_template into goldens.json.

tests/chat/chat_template_test.cpp requires chimera::chat::ChatTemplate to reproduce each rendered prompt
byte for byte (and to fail where transformers raises). Run from anywhere:

    python3 -m venv /tmp/chatvenv && /tmp/chatvenv/bin/pip install transformers jinja2 tokenizers
    /tmp/chatvenv/bin/python scripts/make_chat_goldens.py

torch is not needed: the tokenizer here is a stub that only carries the template and the special tokens.
"""
import json
import pathlib

import jinja2
import tokenizers
import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "chat_templates"

# Special tokens as the checkpoints' tokenizer_config.json declare them.
TEMPLATES = {
    "nemotron-h-8b-reasoning-128k.jinja": ("<s>", "</s>"),
    "nvidia-nemotron-nano-9b-v2.jinja": ("<SPECIAL_10>", "<SPECIAL_12>"),
    "nvidia-nemotron-3-nano-30b-a3b.jinja": ("<s>", "<|im_end|>"),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.\n",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": ["integer", "null"], "minimum": 1},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "  Search the web.  ",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object", "properties": {"site": {"type": "string"}}},
                "limit": {"type": "number"},
            },
        },
    },
}
BARE_TOOL = {"name": "now", "description": "Current time.", "parameters": {"type": "object", "properties": {}}}


def call(name, args, cid="call_1"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "  Be terse.  "},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": " And another? "},
        {"role": "assistant", "content": "Red.\n"},
        {"role": "user", "content": "Thanks"},
    ],
    "history_with_reasoning": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "<think>\n7 has no divisors but 1 and 7.\n</think>\nYes."},
        {"role": "user", "content": "Is 9?"},
        {"role": "assistant", "content": "<think>3*3=9</think>No, 9 = 3 x 3."},
    ],
    "reasoning_content_field": [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "42", "reasoning_content": "Any number works; 42 is classic."},
        {"role": "user", "content": "Why?"},
    ],
    "assistant_last": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Continue the list: a, b,"},
        {"role": "assistant", "content": " c, d"},
    ],
    "nano_v2_think_switch": [
        {"role": "system", "content": "You are precise. /no_think"},
        {"role": "user", "content": "Compute 3*4 /think"},
    ],
    "nemotron_h_reasoning_on": [
        {"role": "system", "content": "{'reasoning': True}"},
        {"role": "user", "content": "Write a haiku about GPUs"},
    ],
    "nemotron_h_reasoning_off": [
        {"role": "system", "content": "Answer briefly.\n{'reasoning': False}"},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Of Italy?"},
    ],
    "unicode_and_escapes": [
        {"role": "system", "content": "Réponds en français — s'il te plaît. \"Quotes\" and \\backslashes\\ and tabs\t."},
        {"role": "user", "content": "日本語のテスト 🚀 <b>html</b> {{ not a tag }} {% raw %}"},
    ],
    "tool_call_and_result": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                call("get_weather", {"city": "Paris", "unit": "celsius"}, "call_a"),
                call("get_weather", {"city": "Rome", "days": 2, "extra": {"k": [1, 2.5, True, None]}}, "call_b"),
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "call_b", "content": "{\"temp\": 25}"},
        {"role": "assistant", "content": "Paris 21°C, Rome 25°C."},
        {"role": "user", "content": "And tomorrow?"},
    ],
    "tool_call_no_content": [
        {"role": "user", "content": "Search for jinja docs"},
        {"role": "assistant", "content": "", "tool_calls": [call("search", {"query": "jinja", "filters": {"site": "palletsprojects.com"}, "limit": 3})]},
        {"role": "tool", "content": "[\"https://jinja.palletsprojects.com\"]"},
    ],
    "tool_call_null_content": [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call("now", {})]},
        {"role": "tool", "content": "12:00"},
    ],
    "tool_call_string_arguments": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", "{\"city\": \"Oslo\"}")]},
        {"role": "tool", "content": "cold"},
    ],
    "tool_call_last_assistant": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "<think>need tool</think>", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
    ],
}

TOOLSETS = {"none": None, "weather_search": [WEATHER_TOOL, SEARCH_TOOL], "bare": [BARE_TOOL], "empty": []}

KWARGS = {
    "default": {},
    "thinking_on": {"enable_thinking": True},
    "thinking_off": {"enable_thinking": False},
    "keep_history": {"enable_thinking": True, "truncate_history_thinking": False},
}


def plan():
    for conv_name in CONVERSATIONS:
        uses_tools = conv_name.startswith("tool_")
        toolsets = ["weather_search", "bare"] if uses_tools else ["none"]
        if conv_name in ("system_user", "user_only"):
            toolsets = ["none", "weather_search", "bare", "empty"]
        for tools_name in toolsets:
            for kw_name in KWARGS:
                for gen in (True, False):
                    yield conv_name, tools_name, kw_name, gen


# Interpreter cases: small templates rendered in transformers' own Jinja environment (the one
# apply_chat_template compiles templates in), covering whitespace control, scoping, filters, tests, methods,
# Python's str() / repr() / json.dumps text, and errors.
JINJA_CASES = [
    # whitespace: trim_blocks, lstrip_blocks, "-" and "+" markers, comments, CRLF, the trailing newline
    ("a\n  {% if true %}\n    b\n  {% endif %}\nc\n", {}),
    ("a  {%- if true -%}  b  {%- endif -%}  c", {}),
    ("x\n    {%+ if true %}y{% endif %}\n", {}),
    ("x {% if true +%}\ny{% endif %}", {}),
    ("{# comment #}\n  {# indented #}\nz\n\n", {}),
    ("a\r\n{% if true %}\r\nb\r\n{% endif %}\r\n", {}),
    ("  {{ 1 }}  \n  {%- set x = 2 %}{{ x }}", {}),
    ("{%- for i in range(3) %}\n  {{ i }}\n{%- endfor %}\n", {}),
    ("{% raw %}{{ not rendered }}{% endraw %}", {}),
    ("tail newline kept once\n\n", {}),
    # expressions and literals
    ("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }} {{ 1 / 3 }}", {}),
    ("{{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1.5e-7 }} {{ 100.0 }} {{ 1e15 }} {{ 12345678.9 }} {{ -0.0 }}", {}),
    ("{{ 'a' ~ 1 ~ none ~ true ~ [1, 'x'] ~ {'k': 'v'} }}", {}),
    ("{{ 'a' + 'b' }} {{ [1] + [2] }} {{ 'ab' * 3 }} {{ 'x' if false }}|{{ 'y' if 0 else 'z' }}", {}),
    ("{{ \"it's\" }} {{ 'say \"hi\"' }} {{ 'tab\\tnl\\n' }} {{ '\\u00e9\\x41' }}", {}),
    ("{{ [1, 2, 3][1:] }} {{ 'hello'[::-1] }} {{ 'héllo'[1:3] }} {{ [1, 2, 3][-1] }} {{ [1,2,3,4,5][::2] }} {{ [1,2][5] }}|", {}),
    ("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' in 'cat' }} {{ 2 not in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 1 == 1.0 }} {{ true == 1 }}", {}),
    ("{{ not none }} {{ none or 'd' }} {{ 0 and 1 }} {{ '' or [] }} {{ [] or 'x' }}", {}),
    ("{{ x }}|{{ x is defined }}|{{ x | default('d') }}|{{ '' | default('e', true) }}|{{ none | default('n') }}", {}),
    ("{{ {'b': 1, 'a': 2} }} {{ [none, true, 1.0, 'q'] }} {{ \"a'b\" | string }} {{ ['a\\'b', 'c\"d'] }}", {}),
    # filters
    ("{{ '  pad  ' | trim }}|{{ 'xxhixx' | trim('x') }}|{{ 'ab' | upper }}|{{ 'AB' | lower }}|{{ 'hello world' | title }}|{{ 'hELLO' | capitalize }}", {}),
    ("{{ [3, 1, 2] | sort }} {{ [3, 1, 2] | sort(reverse=true) }} {{ ['b', 'a'] | join(', ') }} {{ [1, 2] | join }} {{ [1, 2, 2, 3] | unique | list }}", {}),
    ("{{ 'a-b-c' | replace('-', '+') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ [1, 2, 3] | first }} {{ [1, 2, 3] | last }} {{ 'abc' | list }} {{ 'abc' | reverse }}", {}),
    ("{{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ '2.5' | float }} {{ 3 | float }} {{ -3 | abs }} {{ 2.567 | round(2) }} {{ 2.5 | round }}", {}),
    ("{{ 'héllo' | length }} {{ [1, 2] | count }} {{ {'a': 1} | length }} {{ x | length }}", {}),
    ("{{ d | items | list }} {% for k, v in d | items %}{{ k }}={{ v }};{% endfor %} {{ d | dictsort }}", {"d": {"z": 1, "a": [2]}}),
    ("{{ xs | selectattr('on') | map(attribute='n') | list }} {{ xs | rejectattr('on') | map(attribute='n') | join }} {{ xs | selectattr('n', 'equalto', 'b') | list | length }}", {"xs": [{"n": "a", "on": True}, {"n": "b", "on": False}, {"n": "c", "on": True}]}),
    ("{{ [1, 2, 3, 4] | select('odd') | list }} {{ [1, 2, 3, 4] | reject('even') | list }} {{ ['a', 'b'] | map('upper') | list }} {{ [1, 2, 3] | sum }} {{ [3, 1] | min }} {{ [3, 1] | max }}", {}),
    ("{{ v | tojson }}", {"v": {"s": "é\u2028\"\\/\n\t\u0001<>&'", "f": 1.0, "g": 1e-07, "i": -3, "b": [True, False, None], "e": {}, "l": []}}),
    ("{{ v | tojson(indent=2) }}|{{ v | tojson(sort_keys=true) }}|{{ v | tojson(separators=(',', ':')) }}", {"v": {"b": [1, {"c": 2}], "a": "x", "e": []}}),
    ("{{ '<b>&' | e }} {{ 'a\nb\n\nc' | indent(2) }}|{{ 'a\nb' | indent(2, true) }}|{{ 'one two  three' | wordcount }}", {}),
    # tests
    ("{{ none is none }} {{ 1 is number }} {{ true is number }} {{ 1.0 is integer }} {{ 'a' is string }} {{ {} is mapping }} {{ [] is sequence }} {{ 'a' is sequence }} {{ {} is sequence }} {{ x is iterable }} {{ 1 is iterable }}", {}),
    ("{{ 4 is even }} {{ 3 is odd }} {{ 9 is divisibleby 3 }} {{ 1 is true }} {{ true is true }} {{ false is false }} {{ 0 is false }} {{ 2 is gt 1 }} {{ 'a' is in 'cat' }} {{ 'A' is upper }} {{ 'a' is lower }}", {}),
    ("{{ range is callable }} {{ 'x' is not none }} {{ x is undefined }} {{ [1] is eq [1] }} {{ 1 is ne 2 }} {{ 1 is sameas 1 }}", {}),
    # methods
    ("{{ '  a b  '.strip() }}|{{ 'xxa'.lstrip('x') }}|{{ 'a  '.rstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a.b.c'.rsplit('.', 1) }}", {}),
    ("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'aXbX'.replace('X', '-') }} {{ 'abcabc'.find('c') }} {{ 'abc'.find('z') }} {{ 'banana'.count('an') }} {{ '-'.join(['a', 'b']) }} {{ 'AbC'.upper() }} {{ 'AbC'.lower() }} {{ 'ab cd'.title() }}", {}),
    ("{{ d.get('a') }} {{ d.get('z', 'dflt') }} {{ d.get('z') }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.items() | list }} {{ d['a'] }} {{ d.a }} {{ d.missing }}|", {"d": {"a": 1, "b": 2}}),
    ("{{ 'a\nb\r\nc'.splitlines() }} {{ '12'.isdigit() }} {{ 'ab'.isalpha() }} {{ ' '.isspace() }} {{ 'a=b=c'.partition('=') }}", {}),
    # loops
    ("{% for x in xs %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.length }}/{{ loop.first }}/{{ loop.last }}/{{ loop.previtem }}/{{ loop.nextitem }};{% endfor %}", {"xs": ["a", "b", "c"]}),
    ("{% for x in xs if x > 1 %}{{ x }}{{ loop.index }}{% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}", {"xs": [1, 2, 3]}),
    ("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }},{% endfor %}{% for c in 'hé' %}[{{ c }}]{% endfor %}{% for k in {'x': 1, 'y': 2} %}{{ k }}{% endfor %}", {}),
    ("{% for x in [1, 2] %}{{ loop.cycle('odd', 'even') }}{% endfor %}{% for x in [[1, 2], [3]] %}{% for y in x %}{{ loop.index }}{% endfor %}{{ loop.index }};{% endfor %}", {}),
    # scoping: set inside for / if, namespace
    ("{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}|{{ x }}", {}),
    ("{% for i in [1, 2, 3] %}{% if i == 1 %}{% set y = 'set' %}{% endif %}{{ y }};{% endfor %}", {}),
    ("{% set ns = namespace(n=0, s='') %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.n }} {{ ns.s }}", {}),
    ("{% if true %}{% set z = 5 %}{% endif %}{{ z }} {% set a, b = [1, 2] %}{{ a }}{{ b }} {% set t = 1, 2 %}{{ t }}", {}),
    ("{% set block %}inner {{ 1 + 1 }}{% endset %}[{{ block }}] {% set up | upper %}shout{% endset %}{{ up }}", {}),
    ("{% filter upper %}quiet {{ 'words' }}{% endfilter %}", {}),
    # macros and call blocks
    ("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} {{ greet('B', '?') }} {{ greet(punct='.', name='C') }}", {}),
    ("{% macro outer() %}[{{ caller() }}]{% endmacro %}{% call outer() %}body {{ 1 }}{% endcall %}", {}),
    ("{% macro rec(n) %}{% if n > 0 %}{{ n }}{{ rec(n - 1) }}{% endif %}{% endmacro %}{{ rec(4) }}", {}),
    ("{% set g = 'global' %}{% macro show() %}{{ g }}{% endmacro %}{{ show() }}", {}),
    ("{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k=4) }}", {}),
    # transformers' globals
    ("{{ dict(a=1, b='x') }} {{ namespace(a=1).a }}", {}),
    ("{{ raise_exception('custom failure') }}", {}),
    # errors
    ("{% if %}", {}),
    ("{% for x in %}{% endfor %}", {}),
    ("line1\nline2 {{ 1 +  }}", {}),
    ("{% if true %}never closed", {}),
    ("{{ x.y }}", {}),
    ("{{ none.y }}|{{ none.y is defined }}", {}),
    ("{{ 1 + 'a' }}", {}),
    ("{{ 'a' < 1 }}", {}),
    ("{{ 1 // 0 }}", {}),
    ("{% unknowntag %}", {}),
    ("{{ 'x' | nosuchfilter }}", {}),
    ("{{ [1].append(2) }}", {}),
    ("{% set ns = namespace() %}{% set ns._private = 1 %}", {}),
    ("{% set d = {} %}{% set d.x = 1 %}", {}),
    ("{{ 'unterminated }}", {}),
    ("{{ 1 is nosuchtest }}", {}),
    ("{{ undefined_fn() }}", {}),
    ("{{ (1 }}", {}),
]


def jinja_cases():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    out = []
    for template, variables in JINJA_CASES:
        case = {"template": template, "vars": variables}
        try:
            case["expected"] = _compile_jinja_template(template).render(**variables)
        except Exception as e:
            case["error"] = f"{type(e).__name__}: {e}"
        out.append(case)
    return out


def main():
    cases = []
    for template_file, (bos, eos) in TEMPLATES.items():
        source = (FIXTURES / template_file).read_bytes().decode("utf-8")
        tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
            bos_token=bos,
            eos_token=eos,
        )
        tok.chat_template = source
        for conv_name, tools_name, kw_name, gen in plan():
            messages = CONVERSATIONS[conv_name]
            tools = TOOLSETS[tools_name]
            kwargs = KWARGS[kw_name]
            case = {
                "template": template_file,
                "messages": conv_name,
                "tools": tools_name,
                "kwargs": kw_name,
                "add_generation_prompt": gen,
            }
            try:
                case["expected"] = tok.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs
                )
            except Exception as e:  # the template raised: the C++ renderer must raise too
                case["error"] = f"{type(e).__name__}: {e}"
            cases.append(case)
    out = {
        "generator": "scripts/make_chat_goldens.py",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "tokenizers": tokenizers.__version__,
        "special_tokens": {name: {"bos_token": b, "eos_token": e} for name, (b, e) in TEMPLATES.items()},
        "conversations": CONVERSATIONS,
        "toolsets": TOOLSETS,
        "kwargs": KWARGS,
        "cases": cases,
    }
    path = FIXTURES / "goldens.json"
    path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    n_err = sum(1 for c in cases if "error" in c)
    print(f"{path}: {len(cases)} cases ({n_err} where the template raises)")
    jc = jinja_cases()
    jpath = FIXTURES / "jinja_cases.json"
    jpath.write_text(json.dumps({"generator": "scripts/make_chat_goldens.py", "transformers": transformers.__version__,
                                 "jinja2": jinja2.__version__, "cases": jc}, ensure_ascii=False, indent=1) + "\n",
                     encoding="utf-8")
    print(f"{jpath}: {len(jc)} interpreter cases ({sum(1 for c in jc if 'error' in c)} raise)")


if __name__ == "__main__":
    main()

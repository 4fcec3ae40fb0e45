"""Chat templates that render tools, one in each tool-call format gristmill reads (Qwen's /
Hermes' `<tool_call>` and Llama 3's JSON with "parameters"), written after the models' own and
cut down, and tiny model folders that carry them: the tiny llama's weights and tokenizer under
another chat template (tests/tiny_models.py's renders no tools)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Qwen 2.5's template, cut down: the tools in the system turn, calls in <tool_call> tags, tool
# results as a user turn in <tool_response> tags. Without tools, it renders as CHAT_TEMPLATE.
HERMES_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Their signatures, in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nReturn each call as JSON in <tool_call></tool_call> tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Llama 3.1's template, cut down: the tools in the first user turn, a call as JSON with
# "parameters", tool results in an ipython turn
LLAMA3_TEMPLATE = """\
{{- '<|begin_of_text|>' }}
{%- set ns = namespace(tools_done=false) %}
{%- for message in messages %}
{%- if message.role == 'user' and tools and not ns.tools_done %}
{%- set ns.tools_done = true %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, respond with a JSON for a function call.\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    'and its value}. Do not use variables.\\n\\n' }}
{%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>' }}
{{- '{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}<|eom_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content }}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""


def tool_model(model_dir: Path, folder: Path, template: str) -> Path:
    """A copy of a tiny model folder whose chat template is `template`, and whose context is
    4096 tokens: the tiny tokenizer spends a token on every one or two characters of a tool's
    JSON schema. (Its rotary embedding does not depend on the context's length.)"""
    folder.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file():
            shutil.copy(path, folder / path.name)
    (folder / "chat_template.jinja").write_text(template)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return folder

"""OpenAI Batch API files, for the flow of flows/openai_batch.py: a request line read, checked
and mapped to sampling parameters (requests.py, its errors errors.py), a chat line's tools
(tools.py) and the calls read from the model's text (tool_calls.py), a line through the engine
(answers.py), and OpenAI's output lines and bodies (responses.py)."""

"""Structured outputs: grammars that constrain what a request may generate (JSON schemas, regular
expressions, choices, EBNF grammars), compiled with xgrammar and applied as token masks."""

"""kvplug inside vLLM: prefix cache, host tier and attention through vLLM\x27s plugin seams."""

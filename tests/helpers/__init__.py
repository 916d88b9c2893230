"""Shared test helpers: real trainer ranks and a GPT-like state at any layout."""

"""The static linter. Uses libcst; never imports torch, rich or click."""

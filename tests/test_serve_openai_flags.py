"""`inflight serve` hands the OpenAI server's own flags on: each one it takes, the OpenAI server's
parser reads back with the same value (a flag renamed on one side fails here)."""
from client.cli import build_parser
from client.serve import openai_flags
from openai_server.__main__ import build_parser as openai_parser


def test_serve_passes_the_chat_limits_and_the_key_switch_to_the_openai_server():
    args = build_parser().parse_args(["serve", "--max-chat-messages", "7", "--max-chat-rendered-chars", "1234",
                                      "--api-key-all-routes"])
    flags = openai_flags(args)
    parsed = openai_parser().parse_args(["--grpc-url", "localhost:8001", "--model-path", "m", *flags])
    assert parsed.max_chat_messages == 7 and parsed.max_chat_rendered_chars == 1234 and parsed.api_key_all_routes


def test_serve_passes_nothing_it_was_not_given():
    assert openai_flags(build_parser().parse_args(["serve"])) == ()


def test_serve_passes_the_media_rules_and_sets_the_image_limit():
    """Images (docs/vision.md): the URL rules reach the OpenAI server; --limit-mm-per-prompt is the
    engine's limit_mm_per_prompt parameter."""
    args = build_parser().parse_args(["serve", "--allowed-local-media-path", "/srv/img", "--allowed-media-domains",
                                      "a.example", "b.example", "--media-fetch-timeout", "2.5",
                                      "--limit-mm-per-prompt", '{"image": 3}'])
    parsed = openai_parser().parse_args(["--grpc-url", "localhost:8001", *openai_flags(args)])
    assert parsed.allowed_local_media_path == "/srv/img" and parsed.media_fetch_timeout == 2.5
    assert parsed.allowed_media_domains == ["a.example", "b.example"]
    assert args.limit_mm_per_prompt == '{"image": 3}'

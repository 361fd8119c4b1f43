"""The /metrics pages inflight's tools read, through the one reader of the text format
(templates/exposition.py): the benchmarks' scrape sums a series over its instances and leaves the
series split by `state` out, the soak's keeps `name{state}` apart, the GPU check's keeps every label
(escapes undone), and `matching` picks a name's samples by their labels; comments, other servers'
series and malformed lines are skipped."""
import pytest

from client.tools.benchmarks.targets import scrape as bench_scrape
from client.tools.gpu_check.served import scrape as page_series
from client.tools.load.soak import scrape as soak_scrape
from loopback_http import Quiet, serving
from templates.exposition import matching, parse_exposition, read_page

PAGE = """# HELP inflight_num_requests_running Requests running.
# TYPE inflight_num_requests_running gauge
inflight_num_requests_running{model="llm",version="1",instance="llm_0_0"} 2
inflight_num_requests_running{model="llm",version="1",instance="llm_0_1"} 3
inflight_kv_blocks{model="llm",instance="llm_0_0",state="used"} 7
inflight_kv_blocks{model="llm",instance="llm_0_0",state="free"} 9
inflight_generation_tokens_total{model="llm",instance="llm_0_0"} 1.5e3
inflight_lora_info{model="llm",running_lora_adapters="a\\"b,c\\\\d"} 1
nv_inference_count{model="llm"} 4
inflight_broken{model="llm"} not-a-number
"""


@pytest.fixture(scope="module")
def url():
    class Page(Quiet):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_body(PAGE.encode(), content_type="text/plain; version=0.0.4")

    with serving(Page) as (base, _):
        yield f"{base}/metrics"


def test_the_benchmarks_scrape_sums_instances_and_leaves_state_series_out(url):
    assert bench_scrape(url) == {"inflight_num_requests_running": 5.0, "inflight_generation_tokens_total": 1500.0,
                                 "inflight_lora_info": 1.0}


def test_the_soaks_scrape_keeps_each_state_apart(url):
    got = soak_scrape(url)
    assert got["inflight_kv_blocks{used}"] == 7 and got["inflight_kv_blocks{free}"] == 9
    assert "nv_inference_count" not in got and "inflight_broken" not in got


def test_the_gpu_checks_series_keep_every_label_with_its_escapes_undone(url):
    series = page_series(PAGE)
    assert ("inflight_lora_info", {"model": "llm", "running_lora_adapters": 'a"b,c\\d'}, 1.0) in series
    assert [s[0] for s in series].count("inflight_num_requests_running") == 2
    assert all(name.startswith("inflight_") for name, _, _ in series)
    assert read_page(url) == parse_exposition(PAGE)


def test_matching_keeps_a_names_samples_whose_labels_include_the_given_ones(url):
    samples = read_page(url)
    running = matching(samples, "inflight_num_requests_running")
    assert [s.value for s in running] == [2.0, 3.0]
    assert [s.value for s in matching(samples, "inflight_num_requests_running", instance="llm_0_1")] == [3.0]
    assert [s.value for s in matching(samples, "inflight_kv_blocks", state="free")] == [9.0]
    assert matching(samples, "inflight_kv_blocks", state="fre") == []           # labels compare whole, not as substrings
    assert matching(samples, "inflight_kv_blocks", tier="disk") == []           # a label the series lacks
    assert matching(samples, "inflight_kv") == []                               # names compare whole

"""/v1/rerank (Jina's and Cohere's shape, also /rerank) and /score (vLLM's, also /v1/score): with the default
--score-method embedding the default model puts the obviously relevant document first for each query of a small
set; /score gives the same numbers pair by pair; --score-method judge (Qwen3-Reranker's yes/no recipe) gives
probabilities, the same through both routes; bad requests get 400."""

import pytest

from tests.server_harness import cli_args

pytest_plugins = ["server_harness"]

MODEL = "SmolLM2-135M-Instruct"
# (query, the relevant document, unrelated documents)
SET = [
    (
        "What is the capital of France?",
        "Paris is the capital and largest city of France.",
        ["Bananas are rich in potassium.", "The mitochondria is the powerhouse of the cell."],
    ),
    (
        "How do I boil an egg?",
        "Place the egg in boiling water for about nine minutes, then cool it in cold water.",
        ["The stock market closed higher on Friday.", "Jupiter is the largest planet in the solar system."],
    ),
    (
        "Who wrote Romeo and Juliet?",
        "Romeo and Juliet is a tragedy written by William Shakespeare.",
        ["Python is a programming language.", "Rain is water falling from clouds."],
    ),
]


@pytest.mark.parametrize("query, relevant, others", SET)
async def test_rerank_puts_the_relevant_document_first(http, query, relevant, others):
    documents = others[:1] + [relevant] + others[1:]
    r = await http.post("/v1/rerank", json={"model": MODEL, "query": query, "documents": documents})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert [x["index"] for x in results][0] == 1, results
    assert results[0]["document"]["text"] == relevant and body["usage"]["total_tokens"] > 0
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1 for s in scores)
    # Cohere's shape and /rerank: documents as objects, top_n, no documents back
    top = await http.post(
        "/rerank",
        json={"query": query, "documents": [{"text": d} for d in documents], "top_n": 1, "return_documents": False},
    )
    assert top.json()["results"] == [{"index": 1, "relevance_score": pytest.approx(scores[0], rel=1e-4)}]
    # vLLM's /score: one query against every document, scores in the documents' order
    score = await http.post("/score", json={"model": MODEL, "text_1": query, "text_2": documents})
    by_index = {x["index"]: x["relevance_score"] for x in results}
    assert [d["score"] for d in score.json()["data"]] == pytest.approx([by_index[i] for i in range(3)], rel=1e-4)


async def test_cohere_client_reranks(server):
    """Cohere's own SDK (v2, `/v2/rerank`) pointed at the server: the relevant document first, top_n kept."""
    import cohere

    query, relevant, others = SET[0]
    async with cohere.AsyncClientV2(api_key="unused", base_url=server.url) as client:
        r = await client.rerank(model=MODEL, query=query, documents=[*others, relevant], top_n=2)
    assert [x.index for x in r.results][0] == len(others) and len(r.results) == 2
    assert r.results[0].relevance_score >= r.results[1].relevance_score
    async with cohere.AsyncClientV2(api_key="unused", base_url=server.url) as client:
        with pytest.raises(cohere.BadRequestError, match="max_tokens_per_doc"):
            await client.rerank(model=MODEL, query=query, documents=others, max_tokens_per_doc=4)


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 has 2 texts"),
        ("/v1/rerank", {"query": "q", "documents": ["word " * 3000]}, "maximum context length"),
    ],
)
async def test_bad_requests_get_400(http, metrics, path, body, words):
    r = await http.post(path, json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    await metrics.wait_until_idle()


@pytest.mark.slow
async def test_judge_method_gives_probabilities(server_factory):
    import httpx

    server = server_factory(
        "--score-method",
        "judge",
        "--no-dashboard",
        *cli_args(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512),
    )
    query, relevant, others = SET[2]
    documents = others[:1] + [relevant] + others[1:]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        results = (await http.post("/v1/rerank", json={"query": query, "documents": documents})).json()["results"]
        score = (await http.post("/v1/score", json={"text_1": query, "text_2": documents})).json()["data"]
    assert all(0 < x["relevance_score"] < 1 for x in results)
    assert results[0]["index"] == 1  # the 135M model judges this one right (not every query: see README)
    by_index = {x["index"]: x["relevance_score"] for x in results}
    assert [d["score"] for d in score] == pytest.approx([by_index[i] for i in range(3)], rel=1e-4)

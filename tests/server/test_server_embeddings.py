"""POST /v1/embeddings through the official openai SDK: batches of strings and token ids, float and
base64 encodings, usage, and 400s in OpenAI's shape for what the model cannot do."""

import numpy as np
import openai
import pytest

MODEL_NAME = "SmolLM2-135M-Instruct"

pytest_plugins = ["server_harness"]


async def test_batch_float_and_base64_agree(openai_client):
    texts = ["The capital of France is Paris.", "A completely different sentence about cooking pasta."]
    floats = await openai_client.embeddings.create(model=MODEL_NAME, input=texts)
    assert [d.index for d in floats.data] == [0, 1] and floats.model == MODEL_NAME
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (2, 576) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 10
    # the SDK asks for base64 by default and decodes it; ask explicitly and compare the raw bodies too
    raw = await openai_client.embeddings.with_raw_response.create(
        model=MODEL_NAME, input=texts, encoding_format="base64"
    )
    encoded = raw.http_response.json()["data"]
    assert all(isinstance(d["embedding"], str) for d in encoded)
    decoded = (await openai_client.embeddings.create(model=MODEL_NAME, input=texts)).data
    assert np.allclose([d.embedding for d in decoded], vectors, atol=1e-6)
    same = await openai_client.embeddings.create(model=MODEL_NAME, input=texts[0], encoding_format="float")
    assert float(np.dot(same.data[0].embedding, vectors[0])) > 0.9999
    assert float(np.dot(vectors[0], vectors[1])) < 0.999  # different texts, different embeddings


async def test_token_id_inputs(openai_client):
    one = await openai_client.embeddings.create(model=MODEL_NAME, input=[504, 3458, 282], encoding_format="float")
    many = await openai_client.embeddings.create(
        model=MODEL_NAME, input=[[504, 3458, 282], [28, 29]], encoding_format="float"
    )
    assert len(many.data) == 2 and many.usage.prompt_tokens == 5
    assert np.allclose(one.data[0].embedding, many.data[0].embedding, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"input": "Hi", "dimensions": 64}, "dimensions"),
        ({"input": [10**7]}, "input"),
        ({"input": []}, "input"),
        ({"input": "Hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
async def test_bad_requests_get_400_and_the_server_keeps_serving(openai_client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        await openai_client.embeddings.create(model=MODEL_NAME, **kwargs)
    assert e.value.body["param"] == param and e.value.body["message"]
    ok = await openai_client.embeddings.create(model=MODEL_NAME, input="still here", encoding_format="float")
    assert len(ok.data[0].embedding) == 576

"""Writes the prefix-heavy workload, prefix_workload.jsonl: 64 short questions that all start with
the same system prompt (421 tokens once in the model's chat template), so a prefix cache can skip
almost all of every prompt. Compare bench_throughput.py with and without --no-enable-prefix-caching.

With --documents, writes multi_prefix_workload.jsonl instead: 16 documents x 4 questions = 64 chat
requests, each document (the first 16 excerpts of workload.jsonl) a system prompt shared by its 4
questions, interleaved (question 1 of every document, then question 2, ...) so the requests of one
document are spread over a run, as sessions are; each round starts one document later, so a fixed
rotation over an even number of replicas does not keep a document's questions together by accident
(with 16 documents per round, request 16q + d would always land on replica d mod 2). Where a router
sends them decides how much a replica's prefix cache saves (one engine ~3/4 of the prompt tokens,
round_robin over two replicas ~1/2); the one-prefix workload cannot show that, as every replica caches
its single system prompt at once.

Usage: python scripts/data/make_prefix_workload.py [--documents] [--tokenizer HF_DIR] [--max-tokens N]
With no --tokenizer, uses the default model's directory (models.loader.resolve_model).
Fields, as in workload.jsonl: id, prompt (templated text), prompt_token_ids, num_prompt_tokens, max_tokens.
"""

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SYSTEM_PROMPT = """\
You are Ada, the customer support assistant of Northwind Outfitters, an online shop for hiking, \
camping and climbing gear based in Portland, Oregon. Answer in two or three friendly sentences, \
using only the facts below; if a question is not covered, say so and offer to connect the customer \
with a human agent at support@northwind.example.

Orders and shipping. Orders placed before 2 pm Pacific time on a business day ship the same day from \
our warehouse in Portland. Standard shipping takes three to five business days within the contiguous \
United States and is free for orders over 75 dollars; below that it costs 6.95 dollars. Express \
shipping takes one to two days and costs 19 dollars. We ship to Alaska, Hawaii and Canada \
in seven to ten business days for a flat 25 dollars, and we do not ship to other countries yet. \
Every order gets a tracking number by email within four hours of shipping.

Returns and exchanges. Unused items in their original packaging can be returned within 60 days of \
delivery for a full refund to the original payment method; refunds take five business days after \
the return arrives. Members of the Trail Club get 120 days. Return shipping is free with the prepaid \
label from the order page. Used tents, stoves and footwear can only be returned if they are defective.

Warranty and repairs. Our own Northwind-brand gear has a lifetime warranty against defects in \
materials and workmanship; normal wear, accidents and misuse are not covered. Other brands carry \
their manufacturer's warranty, which we help claim. Our repair shop fixes zippers, \
seams and tent poles for 15 dollars plus parts.

Trail Club. Membership is free. Members earn one point per dollar spent, and 100 points are worth a \
5 dollar reward. Members get early access to sales, free express shipping on orders over 150 dollars, \
and a birthday coupon for 15 percent off one item."""

QUESTIONS = [
    "How long does standard shipping take?",
    "Is shipping free?",
    "Do you ship to Germany?",
    "How much does express shipping cost?",
    "When will my order ship if I order at 3 pm?",
    "Can I get my order in Hawaii?",
    "When do I get a tracking number?",
    "How much does it cost to ship to Canada?",
    "Can I return a jacket I bought last month?",
    "How long do I have to return something?",
    "Can I return a tent I used once?",
    "Who pays for return shipping?",
    "When will I get my refund?",
    "How do I exchange shoes for a bigger size?",
    "My stove is broken after one trip. Can I return it?",
    "Do Trail Club members get longer returns?",
    "Is my Northwind backpack covered by a warranty?",
    "The zipper on my sleeping bag broke. Can you fix it?",
    "How much does a repair cost?",
    "How long do repairs take?",
    "Does the warranty cover a tent I ripped on a branch?",
    "Will you help me with a warranty claim for another brand?",
    "Can you repair tent poles?",
    "What does the lifetime warranty cover?",
    "How do I join the Trail Club?",
    "How much does Trail Club membership cost?",
    "How many points do I get per dollar?",
    "What are 500 points worth?",
    "Do members get free express shipping?",
    "Is there a birthday discount?",
    "Do members get early access to sales?",
    "Where is your store?",
    "Is the store open on Sunday?",
    "What time does the store close on Saturday?",
    "Can I rent a tent?",
    "When does a rental weekend start and end?",
    "Can I rent snowshoes?",
    "If I like the tent I rented, can I buy it?",
    "Do you rent climbing ropes?",
    "What is your support email?",
    "Can I talk to a human?",
    "Do you sell kayaks?",
    "What is your phone number?",
    "Can I pick up my online order in the store?",
    "Do you price match other shops?",
    "Can I change my shipping address after ordering?",
    "What happens if my package is lost?",
    "Is there a discount for students?",
    "Can I return a gift without the receipt?",
    "Do you ship on weekends?",
    "Can I return an item bought in the store by mail?",
    "How much is shipping for a 40 dollar order?",
    "Are sleeping pads repairable?",
    "Do points expire?",
    "Can I combine my birthday coupon with a sale?",
    "How long does shipping to Alaska take?",
    "Do you have gift cards?",
    "Is the Portland store open on holidays?",
    "Can I exchange a backpack for a different color?",
    "Do refunds go back to my credit card?",
    "How fast is express shipping?",
    "What brands do you carry?",
    "Can I rent a backpack for a week?",
    "Do you offer climbing lessons?",
]


DOCUMENT_QUESTIONS = [
    "Summarize this text in one sentence.",
    "Who is protected by this text?",
    "What does this text allow?",
    "What does this text forbid?",
]
NUM_DOCUMENTS = 16


def write_documents(tok, out: str, max_tokens: int) -> None:
    with open(HERE / "workload.jsonl") as f:
        documents = [json.loads(line)["prompt"] for line in f if line.strip()][:NUM_DOCUMENTS]
    with open(out, "w") as f:
        for q, question in enumerate(DOCUMENT_QUESTIONS):
            for i in range(NUM_DOCUMENTS):
                d = (i + q) % NUM_DOCUMENTS
                document = documents[d]
                messages = [{"role": "system", "content": document}, {"role": "user", "content": question}]
                prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = tok(prompt, add_special_tokens=False)["input_ids"]
                f.write(
                    json.dumps(
                        {
                            "id": q * NUM_DOCUMENTS + i,
                            "document": d,
                            "prompt": prompt,
                            "prompt_token_ids": ids,
                            "num_prompt_tokens": len(ids),
                            "max_tokens": max_tokens,
                        }
                    )
                    + "\n"
                )
    print(f"wrote {NUM_DOCUMENTS * len(DOCUMENT_QUESTIONS)} requests to {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", action="store_true", help="write the multi-prefix workload instead")
    ap.add_argument("--tokenizer", help="Hugging Face directory with the tokenizer (default: the default model's)")
    ap.add_argument("--max-tokens", type=int, help="tokens to generate per request (default: 64; 32 with --documents)")
    ap.add_argument("--out", help="default: prefix_workload.jsonl, or multi_prefix_workload.jsonl with --documents")
    a = ap.parse_args()
    if a.tokenizer is None:
        sys.path.insert(0, str(HERE.parents[1]))  # the repository root, for `engine`
        from models.loader import resolve_model

        a.tokenizer = resolve_model(None)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    if a.documents:
        return write_documents(tok, a.out or str(HERE / "multi_prefix_workload.jsonl"), a.max_tokens or 32)
    a.out, a.max_tokens = a.out or str(HERE / "prefix_workload.jsonl"), a.max_tokens or 64
    system = {"role": "system", "content": SYSTEM_PROMPT}
    shared = tok.apply_chat_template([system], tokenize=False)
    with open(a.out, "w") as f:
        for i, q in enumerate(QUESTIONS):
            prompt = tok.apply_chat_template(
                [system, {"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            assert prompt.startswith(shared)
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            f.write(
                json.dumps(
                    {
                        "id": i,
                        "prompt": prompt,
                        "prompt_token_ids": ids,
                        "num_prompt_tokens": len(ids),
                        "max_tokens": a.max_tokens,
                    }
                )
                + "\n"
            )
    n_shared = len(tok(shared, add_special_tokens=False)["input_ids"])
    print(f"wrote {len(QUESTIONS)} requests to {a.out}; shared prefix {n_shared} tokens")


if __name__ == "__main__":
    main()

"""The article's reward server design, re-implemented as the benchmark's baseline (not for use).

What it keeps from the article: the model loads at import, an `async def` handler runs a blocking forward, one
request scores one pair, the pair is tokenized as a text pair `tokenizer(prompt, response)` and truncated on the
right at 2048 tokens. `python benchmarks/article_server.py MODEL_DIR PORT`
"""

import sys

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from transformers import AutoModelForSequenceClassification, AutoTokenizer

MODEL_PATH, PORT = sys.argv[1], int(sys.argv[2])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
tokenizer = AutoTokenizer.from_pretrained(MODEL_PATH)
model = AutoModelForSequenceClassification.from_pretrained(
    MODEL_PATH, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32, num_labels=1
).to(DEVICE)
model.eval()
app = FastAPI()


class RewardRequest(BaseModel):
    prompt: str
    response: str


@app.get("/health")
async def health():
    return {"status": "ok"}


@app.post("/score")
async def calculate_score(req: RewardRequest):
    inputs = tokenizer(req.prompt, req.response, return_tensors="pt", truncation=True, max_length=2048).to(model.device)
    with torch.no_grad():
        outputs = model(**inputs)
    return {"score": float(outputs.logits[0].item())}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")

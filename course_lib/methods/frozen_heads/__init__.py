"""Light heads over frozen pretrained features: the course's methods on real photographs.

With 600 training photos a backbone fine-tuned end to end overfits at once, so both backbones stay
frozen and are run once: the image side's 7x7 grid of EfficientNet-Lite0 features (the feature folder
of data_scripts/extract_features.py), the text side's last hidden states of a pretrained BERT (the
offline MiniLM by default; `text_tower="scratch"` learns word embeddings from nothing instead). What
trains is small, one module per idea:

    features   TextStates (every caption's frozen states, computed once per split) and image_tokens
               (a split's grid features, optionally pooled to a coarser grid)
    dual       TokenHead, tokens (B, L, D) -> (B, E): "identity" (the masked mean itself: MiniLM's own
               sentence vector, the text side locked), "mean" (a linear map of the masked mean: the
               linear probe, VSE++'s one pooled vector), "mlp" (the same through a 2-layer MLP, with the
               linear map as a residual) or "attention" (a transformer with [CLS] over the tokens, grid
               boxes added on the image side: LightningDOT's encoders, shallow); HeadsDual, a TokenHead
               per side at a learned temperature, InfoNCE (LightningDOT's CMR) or VSE++'s hinge
    cross      CrossScorer, a single-stream transformer over [CLS] + words + regions (UNITER's
               cross-encoder), one logit per pair
    scan       SCANScorer, SCAN's stacked cross attention (words attending to grid cells) over
               one linear map per side, trained with in-batch InfoNCE
    rerank     the dual encoder's top M re-scored by a pairwise scorer, fused with the dual's logit
    training   the learning curve, optimizer and checkpoint every head shares, and val recalls

The method classes (DualHeadsMethod, CrossHeadsMethod, SCANHeadsMethod, RerankMethod) follow the
benchmark's protocol (fit / rank / query_fn / pairs_per_query), so course_lib.benchmark evaluates and
times them as it does the synthetic methods. They are not registered: nothing ships for real data.
A query's online cost, timed by query_fn, includes encoding its caption through the pretrained text
encoder.
"""

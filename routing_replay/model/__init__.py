"""The model side: find a model's routers, record their routes, force them, measure agreement.

Read in this order:

- `adapters`: each transformers MoE family's router and its score function (`register_router`
  adds one);
- `capture`: record the top-k ids of every MoE layer while a model runs (`hf_cache` reads
  transformers caches without a device sync; `alignment` turns recorded forwards into
  per-sample routes);
- `replay`: force recorded ids in the routers, weights from the live logits (`staging`
  checks and places a batch's routes, `forcing` is the code installed in the model and
  `install` puts it there);
- `agreement`: how often native routing agrees with the recorded routes;
- `aux_loss`: the load-balancing loss of the replayed experts.
"""

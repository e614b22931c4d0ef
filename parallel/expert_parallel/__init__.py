"""Expert parallelism (`parallel.ep`): each mixture-of-experts block's experts split over
ep ranks carved out of the dp x cp ranks; tokens travel to their experts and back by
all-to-all (dispatch.py); apply.py cuts the experts and wires the blocks, also under
tensor parallelism (each TP rank routes its share of the tokens)."""

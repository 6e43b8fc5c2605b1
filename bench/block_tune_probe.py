"""Experiment probe: GPTQ then block-output tuning (aserve/quantization/block_tune.py) of chosen SmolLM2 layers, with
variants of the tuning options; prints each layer's mean squared output error before / after.

    PYTHONPATH=. OMP_NUM_THREADS=2 python bench/block_tune_probe.py 2,11 "dict(steps=100,lr=0.005,scale_lr=0.0)"
"""
import time, torch, sys
import time, torch
from transformers import AutoConfig, AutoTokenizer
from aserve.model.loader import iterate_safetensors, resolve_model
from aserve.quantization.quantize import calibration_ids, data_path, LINEARS
from aserve.quantization.dense_layer import DenseDecoderLayer
from aserve.quantization.gptq import gptq_layer
from aserve.quantization.block_tune import tune_layer
torch.manual_seed(0)
model_dir,_=resolve_model(None)
cfg=AutoConfig.from_pretrained(model_dir); tok=AutoTokenizer.from_pretrained(model_dir)
state=dict(iterate_safetensors(model_dir))
ids=calibration_ids(tok, open(data_path("calibration.txt")).read(), 16, 512)
x=state["model.embed_tokens.weight"].float()[ids.flatten()]
from aserve.quantization.gptq import dequantize
layers=[int(a) for a in sys.argv[1].split(",")]
variants=[eval(v) for v in sys.argv[2:]]
for i in range(max(layers)+1):
    prefix=f"model.layers.{i}."
    w={k.removeprefix(prefix):v.float() for k,v in state.items() if k.startswith(prefix)}
    layer=DenseDecoderLayer(w,cfg,512)
    with torch.no_grad(): xf,_=layer.forward(x,512)
    if i in layers:
        fl={f"{n}.weight":layer.w[f"{n}.weight"].clone() for n in LINEARS}
        with torch.no_grad(): _,grids,_=gptq_layer(layer,x,512,64)
        gq={k:v.clone() for k,v in layer.w.items()}
        for var in variants:
            layer.w.update(gq)
            t1=time.time()
            g2,rep=tune_layer(layer,fl,grids,x,xf,512,**var)
            print(f"layer {i} {var}: {time.time()-t1:.1f}s {rep}",flush=True)
    x=xf

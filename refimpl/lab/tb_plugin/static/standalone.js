// index.html's entry point: the same render() TensorBoard calls inside its iframe.
import {render} from './index.js';

render();
